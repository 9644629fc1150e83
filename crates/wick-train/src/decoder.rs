//! Training passes through the engine's decoder: a packed [`Batch`] runs through
//! [`wick_engine::models::decoder::Decoder::forward_rows`] on the training backend with
//! the factors mounted as an adapter (the same `x·A·B` beside each linear layer that
//! serving runs), the loss rows' log-probabilities come back, and the backward takes
//! `∂L/∂log p` to the factors' gradients through the backend's tape.
use std::collections::HashMap;

use wick_engine::adapters::{LoraWeights, Target};
use wick_engine::backend::tape::{GradRoot, ParamGrads, TapeBackend, TapeMatrix, TapeTensor};
use wick_engine::models::decoder::StagedPass;

pub use wick_engine::backend::tape::Dropout;

use crate::base::{unpermute_rows, BaseWeights};
use crate::error::{Result, TrainError};
use crate::lora::{parts_of, LoraParams};

/// Sequences packed row after row (each attends only to itself, positions restart at 0),
/// and the rows whose next-token log-probability the loss reads.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    /// Every token, sequence after sequence.
    pub tokens: Vec<u32>,
    /// Start row of each sequence, plus the total at the end.
    pub starts: Vec<usize>,
    /// `(row, label)`: the loss reads `log p(label | tokens up to row)`.
    pub targets: Vec<(usize, u32)>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Batch {
        Batch {
            tokens: Vec::new(),
            starts: vec![0],
            targets: Vec::new(),
        }
    }

    /// Appends a sequence; `labeled[t]` says whether token `t` is predicted by the loss
    /// (token 0 never is: nothing precedes it). Returns the index of the new sequence's
    /// first target.
    pub fn push(&mut self, tokens: &[u32], labeled: &[bool]) -> usize {
        let base = self.tokens.len();
        let first = self.targets.len();
        self.tokens.extend_from_slice(tokens);
        for (t, &token) in tokens.iter().enumerate().skip(1) {
            if labeled.get(t).copied().unwrap_or(false) {
                self.targets.push((base + t - 1, token));
            }
        }
        self.starts.push(self.tokens.len());
        first
    }

    /// Rows in all.
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Sequences.
    pub fn sequences(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    fn seqs(&self) -> Vec<&[u32]> {
        self.starts
            .windows(2)
            .map(|w| &self.tokens[w[0]..w[1]])
            .collect()
    }
}

/// LoRA factors applied in a pass, with their multiplier `s` and, in training, the
/// pass's dropout.
#[derive(Debug, Clone, Copy)]
pub struct AdapterRef<'a> {
    /// The factors.
    pub params: &'a LoraParams,
    /// `s` of `y = W·x + s·B·A·x`.
    pub multiplier: f32,
    /// LoRA dropout on the adapter branch's input (`None`: off, as in evaluation).
    pub dropout: Option<Dropout>,
}

impl<'a> AdapterRef<'a> {
    /// `params` at multiplier `multiplier`, without dropout.
    pub fn new(params: &'a LoraParams, multiplier: f32) -> AdapterRef<'a> {
        AdapterRef {
            params,
            multiplier,
            dropout: None,
        }
    }

    /// The same adapter with `dropout` on its branch inputs.
    pub fn with_dropout(self, dropout: Option<Dropout>) -> AdapterRef<'a> {
        AdapterRef { dropout, ..self }
    }
}

/// The parameter ids of the factors of `slot` of `layer` on the backend.
fn ids(layer: usize, slot: usize) -> (usize, usize) {
    let site = layer * Target::COUNT + slot;
    (2 * site, 2 * site + 1)
}

/// Rows `rows` of `b` `[_, rank]`, in that order.
fn gather_rows(b: &[f32], rows: &[usize], rank: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| &b[r * rank..(r + 1) * rank])
        .copied()
        .collect()
}

/// The id under which the backend returns the gradient of a recomputed layer's input
/// (no factor has it: factors' ids are `2·site` and `2·site + 1`).
const LAYER_INPUT: usize = usize::MAX;

/// The result of a forward pass: `log p(label)` per target, and what the backward needs.
pub struct Forward {
    /// Per `Batch::targets` entry.
    pub logp: Vec<f32>,
    /// Where the backward starts: the targets' log-probabilities, whose gradient with
    /// respect to their rows' hidden states the tape keeps (`None`: no target).
    root: Option<GradRoot>,
    /// A checkpointed pass: the layers' inputs, from which the backward recomputes them.
    checkpoints: Option<Checkpoints>,
}

impl std::fmt::Debug for Forward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forward")
            .field("logp", &self.logp)
            .field("checkpointed", &self.checkpoints.is_some())
            .finish_non_exhaustive()
    }
}

/// The ids under which the backend returns the gradients of the keys (`which` 0) and values
/// (1) of cache entry `slot` that a recomputed KV-shared layer read (below
/// [`LAYER_INPUT`], far above any factor's).
fn shared_kv_id(slot: usize, which: usize) -> usize {
    LAYER_INPUT - 1 - 2 * slot - which
}

/// What a checkpointed forward keeps: the residual stream entering each layer from the
/// lowest adapted one up (only the head's ops are on the tape), the mounted factors and
/// the dropout, to run each layer again, recorded, in the backward; and for Gemma 4 the
/// keys and values each producing layer shares with the layers above it.
struct Checkpoints {
    pass: StagedPass<TapeBackend>,
    lora: LoraWeights<TapeBackend>,
    dropout: Option<Dropout>,
    /// Each layer's cache entry and whether it reads another layer's (Gemma 4).
    kv_slots: Option<Vec<(usize, bool)>>,
    /// The keys and values of each shared cache entry, as the forward made them.
    shared: HashMap<usize, (TapeTensor, TapeTensor)>,
    /// The lowest layer with a factor: nothing below it needs a gradient.
    first: usize,
    /// `inputs[i]`: the input of layer `first + i`.
    inputs: Vec<TapeTensor>,
}

/// Training passes over one frozen base.
#[derive(Debug)]
pub struct TrainDecoder<'a> {
    base: &'a BaseWeights,
    max_len: usize,
    /// Gradient checkpointing: a recorded forward keeps each layer's input only, and the
    /// backward runs each layer again (recording it) one at a time.
    checkpoint: bool,
}

impl<'a> TrainDecoder<'a> {
    /// Passes over `base` for sequences of at most `max_len` tokens.
    pub fn new(base: &'a BaseWeights, max_len: usize) -> TrainDecoder<'a> {
        TrainDecoder {
            base,
            max_len: max_len.max(1),
            checkpoint: false,
        }
    }

    /// The same passes with gradient checkpointing on or off: the same gradients, the
    /// peak memory of one layer's activations plus every layer's input, for one more
    /// forward through the adapted layers.
    pub fn with_checkpointing(self, on: bool) -> TrainDecoder<'a> {
        TrainDecoder {
            checkpoint: on,
            ..self
        }
    }

    /// The longest sequence a pass takes.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    fn backend(&self) -> &TapeBackend {
        self.base.decoder.backend()
    }

    fn check(&self, batch: &Batch) -> Result<()> {
        for w in batch.starts.windows(2) {
            if w[1] - w[0] > self.max_len {
                return Err(TrainError::Config(format!(
                    "a sequence of {} tokens exceeds the trainer's {}",
                    w[1] - w[0],
                    self.max_len
                )));
            }
            if w[1] == w[0] {
                return Err(TrainError::Config("an empty sequence in a batch".into()));
            }
        }
        Ok(())
    }

    /// The factors as parameters on the backend, mounted as an adapter: `A`, and
    /// `s·B` in the base's row order.
    fn mount(&self, a: AdapterRef<'_>) -> Result<LoraWeights<TapeBackend>> {
        let be = self.backend();
        let rank = a.params.rank;
        let mut layers = Vec::with_capacity(a.params.layers.len());
        for (l, slots) in a.params.layers.iter().enumerate() {
            let mut out: [Option<(TapeMatrix, TapeMatrix)>; Target::COUNT] =
                std::array::from_fn(|_| None);
            for (slot, pair) in slots.iter().enumerate() {
                let Some(p) = pair else { continue };
                let (ia, _) = ids(l, slot);
                let am = be.parameter(ia, p.a.clone(), rank, p.in_dim, Some((l, slot)))?;
                // Each part of a fused module gets its rows of B (a parameter of its own
                // slot) beside the shared A, whose gradient sums over the parts.
                for (t, rows) in parts_of(&self.base.cfg, l, Target::EVERY[slot]) {
                    let mut b = self.base.permute(t, &gather_rows(&p.b, &rows, rank), rank);
                    b.iter_mut().for_each(|v| *v *= a.multiplier);
                    let (_, ib) = ids(l, t.index());
                    let bm = be.parameter(ib, b, rows.len(), rank, None)?;
                    out[t.index()] = Some((am.clone(), bm));
                }
            }
            layers.push(out);
        }
        Ok(LoraWeights::from_matrices(layers))
    }

    /// The logits of `rows` of `batch` on the backend, or with `hidden` the final-normed
    /// hidden states the output head takes.
    fn pass(
        &self,
        adapter: Option<AdapterRef<'_>>,
        batch: &Batch,
        rows: &[usize],
        record: bool,
        hidden: bool,
    ) -> Result<TapeTensor> {
        self.check(batch)?;
        let be = self.backend();
        be.set_recording(record && adapter.is_some());
        be.set_dropout(adapter.and_then(|a| a.dropout));
        let lora = adapter.map(|a| self.mount(a)).transpose()?;
        let adapters: Vec<&LoraWeights<TapeBackend>> = lora.iter().collect();
        let decoder = &self.base.decoder;
        let out = if hidden {
            decoder.forward_hidden_rows(&batch.seqs(), rows, &adapters)
        } else {
            decoder.forward_rows(&batch.seqs(), rows, &adapters)
        };
        be.set_dropout(None);
        if out.is_err() {
            be.clear();
        }
        Ok(out?)
    }

    /// Every position's logits, `[rows, vocab]` (for parity tests and evaluation).
    pub fn logits(&self, adapter: Option<AdapterRef<'_>>, batch: &Batch) -> Result<Vec<f32>> {
        let rows: Vec<usize> = (0..batch.rows()).collect();
        let t = self.pass(adapter, batch, &rows, false, false)?;
        Ok(t.data().to_vec())
    }

    /// The forward pass: `log p(label)` of every target, the tape kept for
    /// [`TrainDecoder::backward`].
    pub fn forward(&self, adapter: Option<AdapterRef<'_>>, batch: &Batch) -> Result<Forward> {
        self.forward_recording(adapter, batch, true)
    }

    fn forward_recording(
        &self,
        adapter: Option<AdapterRef<'_>>,
        batch: &Batch,
        record: bool,
    ) -> Result<Forward> {
        let rows: Vec<usize> = batch.targets.iter().map(|t| t.0).collect();
        if rows.is_empty() {
            return Ok(Forward {
                logp: Vec::new(),
                root: None,
                checkpoints: None,
            });
        }
        let (hidden, checkpoints) = match adapter {
            Some(a) if record && self.checkpoint => {
                let (out, ck) = self.checkpointed_pass(a, batch, &rows)?;
                (out, Some(ck))
            }
            _ => (self.pass(adapter, batch, &rows, record, true)?, None),
        };
        // The head's product, log-softmax and each target's gradient in chunks of rows:
        // the targets' logits, `[targets, vocab]`, are never held at once.
        let labels: Vec<u32> = batch.targets.iter().map(|t| t.1).collect();
        let head = self.base.decoder.output_head();
        let be = self.backend();
        let out = be.label_log_probs(
            &hidden,
            head.matrix,
            head.bias,
            head.multiplier,
            head.softcap,
            &labels,
        );
        if out.is_err() {
            be.clear();
        }
        let (logp, root) = out?.into_values();
        Ok(Forward {
            logp,
            root: Some(root),
            checkpoints,
        })
    }
    /// A checkpointed forward: the layers run unrecorded, one at a time, each one's input
    /// kept from the lowest adapted layer up; only the final norm of the target rows is
    /// recorded (the head follows), from the last layer's output as a tracked input.
    fn checkpointed_pass(
        &self,
        adapter: AdapterRef<'_>,
        batch: &Batch,
        rows: &[usize],
    ) -> Result<(TapeTensor, Checkpoints)> {
        self.check(batch)?;
        let be = self.backend();
        let decoder = &self.base.decoder;
        let layers = decoder.num_layers();
        let first = adapter
            .params
            .layers
            .iter()
            .position(|slots| slots.iter().any(Option::is_some))
            .unwrap_or(layers)
            .min(layers);
        let lora = self.mount(adapter)?;
        let kv_slots = decoder.kv_slots();
        be.set_recording(false);
        be.set_dropout(adapter.dropout);
        // The keys and values a span's producing layers left for the layers above it.
        let keep_shared =
            |pass: &StagedPass<TapeBackend>,
             span: std::ops::Range<usize>,
             shared: &mut HashMap<usize, (TapeTensor, TapeTensor)>| {
                let Some(slots) = &kv_slots else { return };
                for &(slot, reads) in slots.get(span).unwrap_or_default() {
                    if let (false, Some(kv)) = (reads, pass.shared_kv(slot)) {
                        shared.insert(slot, kv);
                    }
                }
            };
        let run = || -> Result<(TapeTensor, StagedPass<TapeBackend>, Vec<TapeTensor>, _)> {
            let mut shared = HashMap::new();
            let mut pass = decoder.staged_pass(&batch.seqs(), &[&lora])?;
            let mut x = decoder.staged_embed(&pass)?;
            if first > 0 {
                x = decoder.staged_layers(&mut pass, x, 0..first, &[&lora])?;
                keep_shared(&pass, 0..first, &mut shared);
            }
            let mut inputs = Vec::with_capacity(layers - first);
            for l in first..layers {
                inputs.push(x.clone());
                x = decoder.staged_layers(&mut pass, x, l..l + 1, &[&lora])?;
                keep_shared(&pass, l..l + 1, &mut shared);
            }
            be.set_recording(true);
            let x = be.tracked_input(x, LAYER_INPUT);
            let hidden = decoder.staged_hidden(&pass, &x, rows)?;
            Ok((hidden, pass, inputs, shared))
        };
        let out = run();
        be.set_dropout(None);
        if out.is_err() {
            be.clear();
        }
        let (hidden, pass, inputs, shared) = out?;
        Ok((
            hidden,
            Checkpoints {
                pass,
                lora,
                dropout: adapter.dropout,
                kv_slots,
                shared,
                first,
                inputs,
            },
        ))
    }

    /// The backward of a checkpointed pass below its head: from the gradient `dx` of the
    /// last layer's output, each layer from the top down is run again from its saved
    /// input, recorded, and taken back, its factors' gradients collected and its input's
    /// gradient passed to the layer below. One layer's tape is alive at a time. A layer
    /// reading an earlier layer's keys and values (Gemma 4) reads the saved ones as
    /// tracked inputs; their gradients, summed over the readers, are taken back with the
    /// producing layer's output gradient when that layer is run again.
    fn checkpointed_backward(
        &self,
        adapter: AdapterRef<'_>,
        ck: Checkpoints,
        mut dx: Vec<f32>,
        grads: &mut LoraParams,
    ) -> Result<()> {
        let be = self.backend();
        let decoder = &self.base.decoder;
        let Checkpoints {
            mut pass,
            lora,
            dropout,
            kv_slots,
            shared,
            first,
            mut inputs,
        } = ck;
        let slots = kv_slots.unwrap_or_default();
        // The layer making the keys and values of each shared cache entry.
        let producer = |slot: usize| slots.iter().position(|&s| s == (slot, false));
        // The readers' gradients of each entry's keys and values, summed.
        let mut from_readers: HashMap<usize, [Vec<f32>; 2]> = HashMap::new();
        be.set_dropout(dropout);
        let mut run = || -> Result<()> {
            while let Some(x) = inputs.pop() {
                let l = first + inputs.len();
                be.set_recording(true);
                // The lowest adapted layer's input needs no gradient.
                let width = x.data().len();
                let x = if l > first {
                    be.tracked_input(x, LAYER_INPUT)
                } else {
                    x
                };
                let mut read = None;
                if let Some(&(slot, true)) = slots.get(l) {
                    let (k, v) = shared.get(&slot).ok_or_else(|| {
                        TrainError::Config(format!(
                            "layer {l} reads keys and values no layer below it left"
                        ))
                    })?;
                    if producer(slot).is_some_and(|p| p >= first) {
                        let k = be.tracked_input(k.clone(), shared_kv_id(slot, 0));
                        let v = be.tracked_input(v.clone(), shared_kv_id(slot, 1));
                        pass.set_shared_kv(slot, &k, &v)?;
                        read = Some(slot);
                    } else {
                        pass.set_shared_kv(slot, k, v)?;
                    }
                }
                let y = decoder.staged_layers(&mut pass, x, l..l + 1, &[&lora])?;
                let mut roots = vec![(y.grad_root(), std::mem::take(&mut dx))];
                drop(y);
                if let Some(&(slot, false)) = slots.get(l) {
                    if let Some([dk, dv]) = from_readers.remove(&slot) {
                        let (k, v) = pass.shared_kv(slot).ok_or_else(|| {
                            TrainError::Config(format!("layer {l} kept no keys for its readers"))
                        })?;
                        roots.push((k.grad_root(), dk));
                        roots.push((v.grad_root(), dv));
                    }
                }
                let mut found = be.backward_from(roots)?;
                if l > first {
                    dx = found
                        .remove(&LAYER_INPUT)
                        .unwrap_or_else(|| vec![0.0; width]);
                }
                if let Some(slot) = read {
                    for which in 0..2 {
                        let Some(g) = found.remove(&shared_kv_id(slot, which)) else {
                            continue;
                        };
                        match from_readers.get_mut(&slot) {
                            Some(acc) => acc[which].iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                            None => {
                                let len = g.len();
                                let mut both = [vec![0.0; len], vec![0.0; len]];
                                both[which] = g;
                                from_readers.insert(slot, both);
                            }
                        }
                    }
                }
                self.collect(adapter, found, grads);
            }
            Ok(())
        };
        let out = run();
        be.set_dropout(None);
        if out.is_err() {
            be.clear();
        }
        out
    }

    /// `log p(label)` of every target without keeping the tape (a reference policy, an
    /// evaluation).
    pub fn logp(&self, adapter: Option<AdapterRef<'_>>, batch: &Batch) -> Result<Vec<f32>> {
        Ok(self.forward_recording(adapter, batch, false)?.logp)
    }

    /// Adds `∂L/∂(A, B)` into `grads` given `dlogp[i] = ∂L/∂fwd.logp[i]`.
    pub fn backward(
        &self,
        adapter: AdapterRef<'_>,
        batch: &Batch,
        fwd: Forward,
        dlogp: &[f32],
        grads: &mut LoraParams,
    ) -> Result<()> {
        let Forward {
            root, checkpoints, ..
        } = fwd;
        let Some(root) = root else {
            return Ok(());
        };
        if dlogp.len() != batch.targets.len() {
            return Err(TrainError::Config(format!(
                "{} log-probability gradients for {} targets",
                dlogp.len(),
                batch.targets.len()
            )));
        }
        let mut found = self.backend().backward(&root, dlogp.to_vec())?;
        let below = found.remove(&LAYER_INPUT);
        self.collect(adapter, found, grads);
        match (checkpoints, below) {
            (Some(ck), Some(dx)) => self.checkpointed_backward(adapter, ck, dx, grads),
            _ => Ok(()),
        }
    }

    /// Adds the backend's gradients (of `A` and `s·B` in the base's order) into `grads`.
    fn collect(&self, adapter: AdapterRef<'_>, mut found: ParamGrads, grads: &mut LoraParams) {
        let rank = adapter.params.rank;
        for (l, slots) in grads.layers.iter_mut().enumerate() {
            for (slot, pair) in slots.iter_mut().enumerate() {
                let Some(g) = pair else { continue };
                let (ia, _) = ids(l, slot);
                if let Some(da) = found.remove(&ia) {
                    g.a.iter_mut().zip(&da).for_each(|(x, d)| *x += d);
                }
                for (t, rows) in parts_of(&self.base.cfg, l, Target::EVERY[slot]) {
                    let (_, ib) = ids(l, t.index());
                    let Some(db) = found.remove(&ib) else {
                        continue;
                    };
                    let db = match self.base.permuted_heads(t) {
                        Some(heads) => unpermute_rows(&db, heads, rank),
                        None => db,
                    };
                    let s = adapter.multiplier;
                    for (&r, d) in rows.iter().zip(db.chunks_exact(rank)) {
                        g.b[r * rank..(r + 1) * rank]
                            .iter_mut()
                            .zip(d)
                            .for_each(|(x, d)| *x += s * d);
                    }
                }
            }
        }
    }
}
