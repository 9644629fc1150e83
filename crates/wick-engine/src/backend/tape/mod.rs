//! The training backend: the [`Backend`] op surface over host f32 tensors, recording a tape
//! of the ops a pass runs so that the gradient of a scalar of its output can be taken
//! back through them ([`TapeBackend::backward`]).
//!
//! The model code is the serving decoder's (`models::decoder`), unchanged: loaded onto this
//! backend, a forward pass over whole sequences (each from an empty cache) records every
//! op whose result depends on a trainable parameter, and the backward walks the tape in
//! reverse with one rule per op. Trainable parameters are matrices made by
//! [`TapeBackend::parameter`] (the LoRA factors beside the linear layers, mounted as any
//! adapter is, through [`crate::adapters::LoraWeights`]); frozen weights get no
//! gradient, so ops on the frozen path before the first parameter are not recorded at all
//! and the backward stops at the lowest adapted layer.
//!
//! It lives in the engine, next to the other backends, because it is one: the decoder is
//! generic over [`Backend`], and the op surface (and its capability declaration) is the
//! engine's to keep in step. The trainer (`wick-train`) keeps data, losses, optimizer and
//! checkpoints.
//!
//! - `backward.rs`: the tape and each op's backward rule;
//! - `attention.rs`: causal grouped-query attention of whole sequences and its backward;
//! - `deltanet.rs`: Qwen 3.5's gated DeltaNet mixer over whole sequences and its backward;
//! - `products.rs`: the f32 matrix products;
//! - `dropout.rs`: LoRA dropout masks drawn from a key, so the backward draws them again;
//! - `head.rs`: the loss rows' log-probabilities through the output head, in row chunks.
mod attention;
mod backward;
mod deltanet;
mod dropout;
mod head;
pub mod products;

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use rayon::prelude::*;
use wick_gguf::GgmlType;

use self::attention::AttnShape;
use self::backward::{Node, Op, Tape};
pub use self::dropout::Dropout;
use crate::adapters::LoraBatch;
use crate::backend::candle::CpuRope;
use crate::backend::{
    capability, Activation, AttentionParams, AttentionSegment, Backend, DeltaShape, DeltaState,
    KvLayer, KvLayerSnapshot, LowRankDelta, RopeSpec,
};
use crate::kv_pool::BlockLease;
use crate::models::decoder::StagedPass;
use crate::models::moe::Routing;
use crate::weights::{AffineWeight, HostWeight};
use crate::{EngineError, Result};

/// A host activation `[rows, cols]`, and the tape node that produced it when it depends on
/// a trainable parameter.
#[derive(Debug, Clone)]
pub struct TapeTensor {
    data: Arc<Vec<f32>>,
    rows: usize,
    cols: usize,
    node: Option<usize>,
}

impl TapeTensor {
    fn leaf(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        TapeTensor {
            data: Arc::new(data),
            rows,
            cols,
            node: None,
        }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The values, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// Whether a gradient flows back from this tensor (it depends on a parameter).
    pub fn tracked(&self) -> bool {
        self.node.is_some()
    }

    /// Where a backward from this tensor starts (see [`TapeBackend::backward`]).
    pub fn grad_root(&self) -> GradRoot {
        GradRoot {
            node: self.node,
            len: self.data.len(),
            cols: self.cols,
        }
    }

    /// The values (moved out where nothing else holds them, else copied) and the handle
    /// [`TapeBackend::backward`] starts from: a loss computed on the host from a pass's
    /// logits needs them once, not twice.
    pub fn into_values(self) -> (Vec<f32>, GradRoot) {
        let root = GradRoot {
            node: self.node,
            len: self.data.len(),
            cols: self.cols,
        };
        let values = Arc::try_unwrap(self.data).unwrap_or_else(|shared| shared.to_vec());
        (values, root)
    }
}

/// Where a backward starts: the output of a recorded pass (see
/// [`TapeTensor::into_values`]).
#[derive(Debug, Clone, Copy)]
pub struct GradRoot {
    node: Option<usize>,
    len: usize,
    cols: usize,
}

impl GradRoot {
    /// Columns of the output.
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// What a matrix holds.
#[derive(Debug)]
pub(crate) enum Stored {
    /// f32 values.
    F32(Vec<f32>),
    /// A frozen weight kept in its file's encoding (GGUF blocks, f16, bf16), dequantized
    /// for each product.
    Host(HostWeight<'static>),
    /// A frozen MLX affine-quantized weight, dequantized for each product.
    Affine(AffineWeight<'static>),
    /// A trainable parameter.
    Param {
        /// The caller's id, the key of its gradient.
        id: usize,
        values: Vec<f32>,
        /// `(layer, slot)` of a LoRA `A`, whose input LoRA dropout masks.
        dropout_site: Option<(usize, usize)>,
    },
}

impl Stored {
    /// The values, dequantized now where the matrix is kept encoded.
    pub(crate) fn values(&self) -> Result<Cow<'_, [f32]>> {
        Ok(match self {
            Stored::F32(v) | Stored::Param { values: v, .. } => Cow::Borrowed(v),
            Stored::Host(w) => Cow::Owned(w.dequantize()?),
            Stored::Affine(a) => Cow::Owned(a.dequantize()?),
        })
    }

    fn bytes(&self) -> usize {
        match self {
            Stored::F32(v) | Stored::Param { values: v, .. } => v.len() * 4,
            Stored::Host(w) => w.bytes.len(),
            Stored::Affine(a) => a.packed.len() + a.scales.bytes.len() + a.biases.bytes.len(),
        }
    }
}

/// A weight matrix `[rows (out), cols (in)]`, frozen or trainable.
#[derive(Debug, Clone)]
pub struct TapeMatrix {
    stored: Arc<Stored>,
    rows: usize,
    cols: usize,
}

/// Rotary angles of a pass: the forward rotation and its inverse (the backward).
#[derive(Debug)]
pub struct TapeRope {
    fwd: CpuRope,
    back: CpuRope,
}

/// A layer's "cache": whole sequences attend within themselves, so it counts the tokens a
/// pass appended (the decoder reads positions from it) and, where later layers read this
/// layer's keys and values (Gemma 4's KV sharing), holds them as the pass computed them,
/// tape nodes included, so the readers' gradients flow back to the producing layer.
#[derive(Debug)]
pub struct TapeKvLayer {
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    len: usize,
    shared: Option<SharedKv>,
    lease: Option<BlockLease>,
}

/// The keys and values of a pass kept for the layers that share them: the whole batch's,
/// and the rows of this cache's sequence.
#[derive(Debug, Clone)]
struct SharedKv {
    k: TapeTensor,
    v: TapeTensor,
    rows: Range<usize>,
}

impl Clone for TapeKvLayer {
    /// A copy without the pool charge (it holds no blocks).
    fn clone(&self) -> Self {
        TapeKvLayer {
            shared: self.shared.clone(),
            lease: None,
            ..*self
        }
    }
}

impl KvLayer for TapeKvLayer {
    fn len(&self) -> usize {
        self.len
    }
    fn can_trim_to(&self, len: usize) -> bool {
        len == 0
    }
    fn trim(&mut self, len: usize) -> Result<()> {
        if len != 0 {
            return Err(unsupported("trimming a cache"));
        }
        self.len = 0;
        self.shared = None;
        Ok(())
    }
    fn byte_size(&self) -> usize {
        0
    }
    fn snapshot(&self) -> KvLayerSnapshot {
        KvLayerSnapshot {
            start: self.len,
            len: self.len,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            window: self.window,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }
    fn held_blocks(&self) -> usize {
        0
    }
    fn blocks_after(&self, _tokens: usize) -> usize {
        0
    }
    fn peak_blocks(_tokens: usize, _window: Option<usize>, _chunk: usize) -> usize {
        0
    }
    fn lease(&self) -> Option<&BlockLease> {
        self.lease.as_ref()
    }
    fn lease_mut(&mut self) -> &mut Option<BlockLease> {
        &mut self.lease
    }
}

fn unsupported(what: &str) -> EngineError {
    EngineError::Backend {
        backend: "train",
        message: format!("{what} is not supported by the training backend"),
    }
}

fn shape_err(what: String) -> EngineError {
    EngineError::Backend {
        backend: "train",
        message: what,
    }
}

/// Whether a weight is the token embedding or the output head, which stay f32 when the
/// projections are kept encoded (a row gather and the loss rows' logits).
fn is_embedding_or_head(name: &str) -> bool {
    ["embed_tokens", "token_embd", "lm_head", "output.weight"]
        .iter()
        .any(|n| name.contains(n))
}

impl StagedPass<TapeBackend> {
    /// The keys and values cache entry `slot` holds for the layers that read them (Gemma
    /// 4's KV sharing; the batch's, as the producing layer made them), or `None`.
    pub fn shared_kv(&self, slot: usize) -> Option<(TapeTensor, TapeTensor)> {
        let s = self.caches.first()?.layers().get(slot)?.shared.as_ref()?;
        Some((s.k.clone(), s.v.clone()))
    }

    /// Makes cache entry `slot` of every sequence hold `k` and `v` (the batch's, as
    /// [`StagedPass::shared_kv`] gave them) for the layers that read them: a reading
    /// layer run again in the backward, from the saved values or tracked copies of them.
    pub fn set_shared_kv(&mut self, slot: usize, k: &TapeTensor, v: &TapeTensor) -> Result<()> {
        for (cache, rows) in self.caches.iter_mut().zip(&self.ranges) {
            let layer = cache
                .layers_mut()
                .get_mut(slot)
                .ok_or_else(|| shape_err(format!("no cache entry {slot}")))?;
            layer.len = rows.len();
            layer.shared = Some(SharedKv {
                k: k.clone(),
                v: v.clone(),
                rows: rows.clone(),
            });
        }
        Ok(())
    }
}

/// The gradient of every parameter a backward reached, by the id it was made with.
pub type ParamGrads = HashMap<usize, Vec<f32>>;

/// The training backend (see the module documentation).
#[derive(Debug, Default)]
pub struct TapeBackend {
    /// Keep frozen projections in their file's encoding (QLoRA), else f32.
    keep_stored: bool,
    tape: Mutex<Tape>,
    /// The LoRA dropout of the pass being recorded.
    dropout: Mutex<Option<Dropout>>,
    /// The encodings the weights came in (`f32`, `Q4_1`, `mlx-affine-4bit` …), for logs.
    stored_types: Mutex<BTreeSet<String>>,
}

impl TapeBackend {
    /// A backend that dequantizes frozen weights to f32 at load (`keep_stored`: keeps the
    /// projections as the file stores them and dequantizes each for its products).
    pub fn new(keep_stored: bool) -> Self {
        TapeBackend {
            keep_stored,
            ..Default::default()
        }
    }

    fn tape(&self) -> MutexGuard<'_, Tape> {
        self.tape.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A trainable matrix `[rows, cols]` whose gradient [`TapeBackend::backward`] returns
    /// under `id`. `dropout_site` `(layer, slot)`: a LoRA `A` whose input gets the pass's
    /// LoRA dropout ([`TapeBackend::set_dropout`]).
    pub fn parameter(
        &self,
        id: usize,
        values: Vec<f32>,
        rows: usize,
        cols: usize,
        dropout_site: Option<(usize, usize)>,
    ) -> Result<TapeMatrix> {
        if values.len() != rows * cols {
            return Err(shape_err(format!(
                "parameter {id}: {} values for {rows}x{cols}",
                values.len()
            )));
        }
        Ok(TapeMatrix {
            stored: Arc::new(Stored::Param {
                id,
                values,
                dropout_site,
            }),
            rows,
            cols,
        })
    }

    /// Starts a pass: forgets what was recorded, and records the ops that follow (the
    /// default) or not (a pass whose gradient is not wanted: a reference model, an
    /// evaluation).
    pub fn set_recording(&self, on: bool) {
        let mut tape = self.tape();
        tape.recording = on;
        tape.nodes.clear();
    }

    /// `x` as the input of a recorded span whose gradient the backward returns under `id`
    /// beside the parameters' (pick an id no parameter has): gradient checkpointing
    /// re-runs a layer from its saved input and carries that gradient down to the layer
    /// below. Untracked (as `x` is) when the tape does not record.
    pub fn tracked_input(&self, x: TapeTensor, id: usize) -> TapeTensor {
        let (rows, cols) = (x.rows, x.cols);
        self.out_shared(x.data, rows, cols, true, || Op::Input { id })
    }

    /// The LoRA dropout of the passes that follow (`None`: off).
    pub fn set_dropout(&self, d: Option<Dropout>) {
        *self.dropout.lock().unwrap_or_else(|e| e.into_inner()) = d;
    }

    /// The most ops the tape held at once since the last call (how much a pass kept
    /// for its backward: gradient checkpointing holds one layer's).
    pub fn take_peak_ops(&self) -> usize {
        std::mem::take(&mut self.tape().peak)
    }

    /// Forgets the recorded ops.
    pub fn clear(&self) {
        self.tape().nodes.clear();
    }

    /// The gradient of `Σ output ⊙ grad` with respect to every parameter the recorded
    /// pass used, by id; the tape is emptied. `grad` is `[rows, cols]` of `output`.
    pub fn backward(&self, output: &GradRoot, grad: Vec<f32>) -> Result<ParamGrads> {
        self.backward_from(vec![(*output, grad)])
    }

    /// [`TapeBackend::backward`] of `Σᵢ outputᵢ ⊙ gradᵢ` over several outputs of the
    /// recorded pass (a recomputed layer's output and the keys and values it shares with
    /// the layers above, whose gradients those layers gave); the tape is emptied.
    pub fn backward_from(&self, roots: Vec<(GradRoot, Vec<f32>)>) -> Result<ParamGrads> {
        for (output, grad) in &roots {
            if grad.len() != output.len {
                return Err(shape_err(format!(
                    "backward: a gradient of {} values for an output of {}",
                    grad.len(),
                    output.len
                )));
            }
        }
        let nodes = std::mem::take(&mut self.tape().nodes);
        let seeds: Vec<(usize, Vec<f32>)> = roots
            .into_iter()
            .filter_map(|(output, grad)| output.node.map(|n| (n, grad)))
            .collect();
        if seeds.is_empty() {
            return Ok(ParamGrads::new());
        }
        if let Some(&(bad, _)) = seeds.iter().find(|(n, _)| *n >= nodes.len()) {
            return Err(shape_err(format!(
                "backward: node {bad} of a tape of {}",
                nodes.len()
            )));
        }
        backward::run(nodes, seeds)
    }

    /// `log p(labels[i])` of each row of `x`, the final-normed hidden states of the loss
    /// rows, under the output head `softcap(multiplier · (x·wᵀ + bias))`
    /// ([`crate::models::decoder::Decoder::output_head`]), as `[rows, 1]`. The head's
    /// product, log-softmax and each row's gradient run in chunks of rows, so the
    /// `[rows, vocab]` logits are never held at once; recorded (the gradient of each
    /// log-probability with respect to its row kept for the backward) when `x` is.
    pub fn label_log_probs(
        &self,
        x: &TapeTensor,
        w: &TapeMatrix,
        bias: Option<&TapeTensor>,
        multiplier: Option<f32>,
        softcap: Option<f32>,
        labels: &[u32],
    ) -> Result<TapeTensor> {
        if x.cols != w.cols || labels.len() != x.rows {
            return Err(shape_err(format!(
                "label_log_probs: {}x{} hidden states with {} labels for a {}x{} head",
                x.rows,
                x.cols,
                labels.len(),
                w.rows,
                w.cols
            )));
        }
        if let Some(&bad) = labels.iter().find(|&&l| l as usize >= w.rows) {
            return Err(EngineError::InvalidInput(format!(
                "label {bad} is outside the vocabulary of {}",
                w.rows
            )));
        }
        if let Some(b) = bias.filter(|b| b.data.len() != w.rows) {
            return Err(shape_err(format!(
                "label_log_probs: a bias of {} for {} logits",
                b.data.len(),
                w.rows
            )));
        }
        let grad = x.node.is_some() && self.tape().recording;
        let values = w.stored.values()?;
        let spec = head::Head {
            w: &values,
            vocab: w.rows,
            hidden: w.cols,
            bias: bias.map(|b| b.data.as_slice()),
            multiplier,
            softcap,
        };
        let (logp, dx) = head::label_log_probs(spec, &x.data, labels, grad);
        let n = x.rows;
        Ok(match (x.node, dx) {
            (Some(xn), Some(dx)) => self.out(logp, n, 1, true, || Op::LabelLogProb {
                x: xn,
                dx,
                cols: w.cols,
            }),
            _ => TapeTensor::leaf(logp, n, 1),
        })
    }

    /// The encodings the frozen weights came in, joined by `+` (`Q4_1+Q6_K`).
    pub fn stored_as(&self) -> String {
        let types = self.stored_types.lock().unwrap_or_else(|e| e.into_inner());
        types.iter().cloned().collect::<Vec<_>>().join("+")
    }

    fn note_type(&self, t: String) {
        self.stored_types
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(t);
    }

    /// A result tensor: recorded as `op` when `tracked` and the tape records.
    fn out(
        &self,
        data: Vec<f32>,
        rows: usize,
        cols: usize,
        tracked: bool,
        op: impl FnOnce() -> Op,
    ) -> TapeTensor {
        self.out_shared(Arc::new(data), rows, cols, tracked, op)
    }

    /// [`TapeBackend::out`] of values the op also keeps.
    fn out_shared(
        &self,
        data: Arc<Vec<f32>>,
        rows: usize,
        cols: usize,
        tracked: bool,
        op: impl FnOnce() -> Op,
    ) -> TapeTensor {
        let node = if tracked {
            let mut tape = self.tape();
            tape.recording.then(|| {
                tape.nodes.push(Node {
                    op: op(),
                    len: data.len(),
                });
                tape.peak = tape.peak.max(tape.nodes.len());
                tape.nodes.len() - 1
            })
        } else {
            None
        };
        TapeTensor {
            data,
            rows,
            cols,
            node,
        }
    }

    fn frozen(&self, w: HostWeight<'_>) -> Result<TapeMatrix> {
        let (rows, cols) = match w.shape.as_slice() {
            [r, c] => (*r, *c),
            [n] => (1, *n),
            s => return Err(shape_err(format!("{}: a matrix of shape {s:?}", w.name))),
        };
        if w.dtype != GgmlType::F32 && rows > 1 {
            self.note_type(w.dtype.to_string());
        }
        let stored =
            if self.keep_stored && w.dtype != GgmlType::F32 && !is_embedding_or_head(&w.name) {
                // Checked once here, so a product's dequantization cannot fail later.
                w.dequantize()?;
                Stored::Host(HostWeight {
                    name: w.name,
                    dtype: w.dtype,
                    shape: w.shape,
                    bytes: Cow::Owned(w.bytes.into_owned()),
                })
            } else {
                let v = w.dequantize()?;
                if v.len() != rows * cols {
                    return Err(shape_err(format!(
                        "{}: {} values for {rows}x{cols}",
                        w.name,
                        v.len()
                    )));
                }
                Stored::F32(v)
            };
        Ok(TapeMatrix {
            stored: Arc::new(stored),
            rows,
            cols,
        })
    }

    /// `x` under the pass's LoRA dropout, where `a` is a LoRA `A` and dropout is on.
    fn lora_input(&self, x: &TapeTensor, a: &TapeMatrix) -> TapeTensor {
        let Stored::Param {
            dropout_site: Some((layer, slot)),
            ..
        } = &*a.stored
        else {
            return x.clone();
        };
        let Some(d) = *self.dropout.lock().unwrap_or_else(|e| e.into_inner()) else {
            return x.clone();
        };
        let out = d.apply(&x.data, x.cols, *layer, *slot);
        let (layer, slot, width) = (*layer, *slot, x.cols);
        match x.node {
            Some(xn) => self.out(out, x.rows, x.cols, true, || Op::Dropout {
                x: xn,
                d,
                layer,
                slot,
                width,
            }),
            None => TapeTensor::leaf(out, x.rows, x.cols),
        }
    }

    /// `y + x·wᵀ`, the product accumulated into `y`'s values (in place where nothing
    /// else holds them): a LoRA branch's `B` product added to the base output without a
    /// buffer for the product and a pass to add it.
    fn linear_add(&self, y: TapeTensor, x: &TapeTensor, w: &TapeMatrix) -> Result<TapeTensor> {
        if x.cols != w.cols || y.cols != w.rows || y.rows != x.rows {
            return Err(shape_err(format!(
                "linear_add: {}x{} plus {}x{} times a {}x{} matrix transposed",
                y.rows, y.cols, x.rows, x.cols, w.rows, w.cols
            )));
        }
        let (n, out, inp) = (x.rows, w.rows, w.cols);
        let yn = y.node;
        let mut values = Arc::try_unwrap(y.data).unwrap_or_else(|shared| shared.to_vec());
        products::gemm(
            n,
            out,
            inp,
            &x.data,
            products::Layout::Plain,
            &w.stored.values()?,
            products::Layout::Transposed,
            &mut values,
            true,
            1.0,
            true,
        );
        let param = matches!(*w.stored, Stored::Param { .. });
        let tracked = yn.is_some() || x.node.is_some() || param;
        Ok(self.out(values, n, out, tracked, || Op::LinearAdd {
            y: yn,
            x: x.node,
            x_val: param.then(|| x.data.clone()),
            w: w.stored.clone(),
            n,
            inp,
            out,
        }))
    }

    /// Causal attention of `q` to `k`, `v` within each sequence's rows `ranges`,
    /// recorded where any of them is tracked.
    fn attend(
        &self,
        q: &TapeTensor,
        k: &TapeTensor,
        v: &TapeTensor,
        ranges: Vec<Range<usize>>,
        params: &AttentionParams,
    ) -> Result<TapeTensor> {
        let s = AttnShape::of(params);
        if q.cols != s.heads * s.hd
            || k.cols != s.kv_heads * s.hd
            || v.cols != k.cols
            || k.rows != q.rows
            || v.rows != q.rows
            || s.kv_heads == 0
            || !s.heads.is_multiple_of(s.kv_heads)
        {
            return Err(shape_err(format!(
                "attention: q {}x{}, k {}x{}, v {}x{} for {} heads, {} kv heads of {}",
                q.rows, q.cols, k.rows, k.cols, v.rows, v.cols, s.heads, s.kv_heads, s.hd
            )));
        }
        if let Some(r) = ranges.iter().find(|r| r.end > q.rows) {
            return Err(shape_err(format!(
                "attention: segment rows {r:?} of {}",
                q.rows
            )));
        }
        let (out, probs) = attention::forward(s, &q.data, &k.data, &v.data, &ranges);
        let (qn, kn, vn) = (q.node, k.node, v.node);
        let tracked = qn.is_some() || kn.is_some() || vn.is_some();
        let rows = q.rows;
        Ok(self.out(out, rows, q.cols, tracked, || Op::Attention {
            q: qn,
            k: kn,
            v: vn,
            q_val: q.data.clone(),
            k_val: k.data.clone(),
            v_val: v.data.clone(),
            probs,
            segments: ranges,
            shape: s,
            rows,
        }))
    }

    /// The routing weights `[rows, k]` of `routing` as a function of the router's
    /// `logits` (recorded where they are tracked).
    fn route_weights(&self, logits: &TapeTensor, routing: &Routing, scale: &[f32]) -> TapeTensor {
        let (rows, k) = (routing.rows(), routing.top_k);
        let w = routing.weights.clone();
        match logits.node {
            Some(ln) => {
                let n = logits.cols;
                let mut probs = logits.data.to_vec();
                for row in probs.chunks_exact_mut(n.max(1)) {
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for p in row.iter_mut() {
                        *p = (*p - max).exp();
                        sum += *p;
                    }
                    row.iter_mut().for_each(|p| *p /= sum);
                }
                self.out(w, rows, k, true, || Op::RouteWeights {
                    logits: ln,
                    probs,
                    experts: routing.experts.clone(),
                    scale: scale.to_vec(),
                    n,
                    k,
                })
            }
            None => TapeTensor::leaf(w, rows, k),
        }
    }

    /// Row `i` of `y` times value `slots[i]` of `w` (an expert's outputs times their
    /// routing weights).
    fn weighted_rows(&self, y: &TapeTensor, w: &TapeTensor, slots: &[usize]) -> Result<TapeTensor> {
        if slots.len() != y.rows || slots.iter().any(|&s| s >= w.data.len()) {
            return Err(shape_err(format!(
                "weighted_rows: {} rows, {} weights for {} slots",
                y.rows,
                w.data.len(),
                slots.len()
            )));
        }
        let cols = y.cols;
        let mut out = y.data.to_vec();
        for (row, &s) in out.chunks_exact_mut(cols.max(1)).zip(slots) {
            row.iter_mut().for_each(|v| *v *= w.data[s]);
        }
        let (yn, wn) = (y.node, w.node);
        Ok(
            self.out(out, y.rows, cols, yn.is_some() || wn.is_some(), || {
                Op::WeightedRows {
                    y: yn,
                    w: wn,
                    y_val: y.data.clone(),
                    w_val: w.data.clone(),
                    slots: slots.to_vec(),
                    cols,
                }
            }),
        )
    }

    fn check_same(op: &str, a: &TapeTensor, b: &TapeTensor) -> Result<()> {
        if a.rows != b.rows || a.cols != b.cols {
            return Err(shape_err(format!(
                "{op}: {}x{} and {}x{}",
                a.rows, a.cols, b.rows, b.cols
            )));
        }
        Ok(())
    }
}

/// Element-wise ops on fewer values than this run on the calling thread; larger ones (a
/// pass's MLP activations are rows × intermediate values) are split over the rayon pool,
/// as the backward's rules are, so the pool's threads do not wait on the forward's serial
/// steps. Each value is computed the same way either way.
const PARALLEL_VALUES: usize = 1 << 14;

/// `f` of each value of `x`.
fn map_values(x: &[f32], f: impl Fn(f32) -> f32 + Sync + Send) -> Vec<f32> {
    if x.len() < PARALLEL_VALUES {
        x.iter().map(|&v| f(v)).collect()
    } else {
        x.par_iter()
            .with_min_len(PARALLEL_VALUES / 4)
            .map(|&v| f(v))
            .collect()
    }
}

/// `f` of each pair of values of `a` and `b` (the same length).
fn zip_values(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync + Send) -> Vec<f32> {
    if a.len() < PARALLEL_VALUES {
        a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()
    } else {
        a.par_iter()
            .zip(b.par_iter())
            .with_min_len(PARALLEL_VALUES / 4)
            .map(|(&x, &y)| f(x, y))
            .collect()
    }
}

/// Activation `act` of `g` and its derivative.
pub(crate) fn activate(act: Activation, g: f32) -> (f32, f32) {
    match act {
        Activation::Silu => {
            let s = 1.0 / (1.0 + (-g).exp());
            (g * s, s * (1.0 + g * (1.0 - s)))
        }
        Activation::GeluTanh => {
            const C: f32 = 0.797_884_6; // sqrt(2/π)
            let inner = C * (g + 0.044_715 * g * g * g);
            let t = inner.tanh();
            let d = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * C * (1.0 + 3.0 * 0.044_715 * g * g);
            (0.5 * g * (1.0 + t), d)
        }
    }
}

impl Backend for TapeBackend {
    type Tensor = TapeTensor;
    type Matrix = TapeMatrix;
    type Rope = Arc<TapeRope>;
    type KvLayer = TapeKvLayer;
    type Ids = Vec<u32>;
    type DeltaState = DeltaState;

    fn name(&self) -> &'static str {
        "train"
    }

    fn matrix(&self, w: HostWeight<'_>) -> Result<TapeMatrix> {
        self.frozen(w)
    }

    fn affine_matrix(&self, w: AffineWeight<'_>) -> Result<TapeMatrix> {
        self.note_type(format!("mlx-affine-{}bit", w.bits));
        let (rows, cols) = (w.rows, w.cols);
        let stored = if self.keep_stored && !is_embedding_or_head(&w.name) {
            w.dequantize()?;
            let owned = |h: HostWeight<'_>| HostWeight {
                name: h.name,
                dtype: h.dtype,
                shape: h.shape,
                bytes: Cow::Owned(h.bytes.into_owned()),
            };
            Stored::Affine(AffineWeight {
                name: w.name,
                rows: w.rows,
                cols: w.cols,
                bits: w.bits,
                group_size: w.group_size,
                packed: Cow::Owned(w.packed.into_owned()),
                scales: owned(w.scales),
                biases: owned(w.biases),
            })
        } else {
            Stored::F32(w.dequantize()?)
        };
        Ok(TapeMatrix {
            stored: Arc::new(stored),
            rows,
            cols,
        })
    }

    fn vector(&self, w: HostWeight<'_>) -> Result<TapeTensor> {
        let v = w.dequantize()?;
        let n = v.len();
        Ok(TapeTensor::leaf(v, 1, n))
    }

    fn matrix_shape(&self, m: &TapeMatrix) -> (usize, usize) {
        (m.rows, m.cols)
    }

    fn matrix_bytes(&self, m: &TapeMatrix) -> usize {
        m.stored.bytes()
    }

    fn embed(&self, table: &TapeMatrix, ids: &[u32]) -> Result<TapeTensor> {
        let values = table.stored.values()?;
        let h = table.cols;
        let mut out = Vec::with_capacity(ids.len() * h);
        for &id in ids {
            let id = id as usize;
            if id >= table.rows {
                return Err(EngineError::InvalidInput(format!(
                    "token id {id} is outside the vocabulary of {}",
                    table.rows
                )));
            }
            out.extend_from_slice(&values[id * h..(id + 1) * h]);
        }
        Ok(TapeTensor::leaf(out, ids.len(), h))
    }

    fn linear(
        &self,
        x: &TapeTensor,
        w: &TapeMatrix,
        bias: Option<&TapeTensor>,
    ) -> Result<TapeTensor> {
        if x.cols != w.cols {
            return Err(shape_err(format!(
                "linear: input of {} columns for a {}x{} matrix",
                x.cols, w.rows, w.cols
            )));
        }
        let (n, out, inp) = (x.rows, w.rows, w.cols);
        let mut y = products::linear(&x.data, n, &w.stored.values()?, out, inp);
        if let Some(b) = bias {
            if b.data.len() != out {
                return Err(shape_err(format!(
                    "linear: bias of {} for {out}",
                    b.data.len()
                )));
            }
            for row in y.chunks_exact_mut(out.max(1)) {
                row.iter_mut().zip(b.data.iter()).for_each(|(v, b)| *v += b);
            }
        }
        let param = matches!(*w.stored, Stored::Param { .. });
        Ok(
            self.out(y, n, out, x.node.is_some() || param, || Op::Linear {
                x: x.node,
                x_val: param.then(|| x.data.clone()),
                w: w.stored.clone(),
                n,
                inp,
                out,
            }),
        )
    }

    fn add(&self, a: &TapeTensor, b: &TapeTensor) -> Result<TapeTensor> {
        Self::check_same("add", a, b)?;
        let y = zip_values(&a.data, &b.data, |x, y| x + y);
        let (an, bn) = (a.node, b.node);
        Ok(
            self.out(y, a.rows, a.cols, an.is_some() || bn.is_some(), || {
                Op::Add { a: an, b: bn }
            }),
        )
    }

    fn scale(&self, x: &TapeTensor, s: f32) -> Result<TapeTensor> {
        let y = map_values(&x.data, |v| v * s);
        Ok(match x.node {
            Some(xn) => self.out(y, x.rows, x.cols, true, || Op::Scale { x: xn, s }),
            None => TapeTensor::leaf(y, x.rows, x.cols),
        })
    }

    fn rms_norm(&self, x: &TapeTensor, weight: &TapeTensor, eps: f32) -> Result<TapeTensor> {
        let h = weight.data.len();
        if h == 0 || !x.data.len().is_multiple_of(h) {
            return Err(shape_err(format!(
                "rms_norm: {} values in groups of {h}",
                x.data.len()
            )));
        }
        let (y, inv) = backward::rms_norm(&x.data, &weight.data, eps);
        Ok(match x.node {
            Some(xn) => self.out(y, x.rows, x.cols, true, || Op::RmsNorm {
                x: xn,
                x_val: x.data.clone(),
                w: weight.data.clone(),
                inv,
            }),
            None => TapeTensor::leaf(y, x.rows, x.cols),
        })
    }

    fn layer_norm(
        &self,
        x: &TapeTensor,
        weight: &TapeTensor,
        bias: Option<&TapeTensor>,
        eps: f32,
    ) -> Result<TapeTensor> {
        let h = weight.data.len();
        if h == 0 || !x.cols.is_multiple_of(h) || bias.is_some_and(|b| b.data.len() != h) {
            return Err(shape_err(format!(
                "layer_norm: {} columns with a weight of {h}",
                x.cols
            )));
        }
        let (y, stats) =
            backward::layer_norm(&x.data, &weight.data, bias.map(|b| b.data.as_slice()), eps);
        Ok(match x.node {
            Some(xn) => self.out(y, x.rows, x.cols, true, || Op::LayerNorm {
                x: xn,
                x_val: x.data.clone(),
                w: weight.data.clone(),
                stats,
            }),
            None => TapeTensor::leaf(y, x.rows, x.cols),
        })
    }

    fn activation(&self, x: &TapeTensor, act: Activation) -> Result<TapeTensor> {
        let y = map_values(&x.data, |v| activate(act, v).0);
        Ok(match x.node {
            Some(xn) => self.out(y, x.rows, x.cols, true, || Op::Activation {
                x: xn,
                x_val: x.data.clone(),
                act,
            }),
            None => TapeTensor::leaf(y, x.rows, x.cols),
        })
    }

    fn split_columns(&self, x: &TapeTensor, widths: &[usize]) -> Result<Vec<TapeTensor>> {
        let cols = x.cols;
        if widths.iter().sum::<usize>() != cols {
            return Err(shape_err(format!(
                "split of {cols} columns into {widths:?}"
            )));
        }
        let mut at = 0;
        let mut out = Vec::with_capacity(widths.len());
        for &width in widths {
            let mut part = Vec::with_capacity(x.rows * width);
            for row in x.data.chunks_exact(cols.max(1)) {
                part.extend_from_slice(&row[at..at + width]);
            }
            let t = match x.node {
                Some(xn) => self.out(part, x.rows, width, true, || Op::Columns {
                    x: xn,
                    cols,
                    at,
                    width,
                }),
                None => TapeTensor::leaf(part, x.rows, width),
            };
            out.push(t);
            at += width;
        }
        Ok(out)
    }

    fn glu(&self, gate: &TapeTensor, up: &TapeTensor, act: Activation) -> Result<TapeTensor> {
        Self::check_same("glu", gate, up)?;
        let y = zip_values(&gate.data, &up.data, |g, u| activate(act, g).0 * u);
        let (gn, un) = (gate.node, up.node);
        Ok(self.out(
            y,
            gate.rows,
            gate.cols,
            gn.is_some() || un.is_some(),
            || Op::Glu {
                gate: gn,
                up: un,
                g: gate.data.clone(),
                u: up.data.clone(),
                act,
            },
        ))
    }

    fn capabilities(&self) -> &'static capability::Capabilities {
        &capability::TRAIN
    }

    fn softcap(&self, x: &TapeTensor, cap: f32) -> Result<TapeTensor> {
        let y = Arc::new(map_values(&x.data, |v| cap * (v / cap).tanh()));
        let saved = y.clone();
        let xn = x.node;
        Ok(
            self.out_shared(y, x.rows, x.cols, xn.is_some(), || Op::Softcap {
                x: xn.unwrap_or_default(),
                y: saved,
                cap,
            }),
        )
    }

    fn select_rows(&self, x: &TapeTensor, rows: &[usize]) -> Result<TapeTensor> {
        let cols = x.cols;
        let mut out = Vec::with_capacity(rows.len() * cols);
        for &r in rows {
            if r >= x.rows {
                return Err(shape_err(format!("select_rows: row {r} of {}", x.rows)));
            }
            out.extend_from_slice(&x.data[r * cols..(r + 1) * cols]);
        }
        Ok(match x.node {
            Some(xn) => self.out(out, rows.len(), cols, true, || Op::SelectRows {
                x: xn,
                rows: rows.to_vec(),
                src_len: x.data.len(),
                cols,
            }),
            None => TapeTensor::leaf(out, rows.len(), cols),
        })
    }

    fn rows_to_host(&self, x: &TapeTensor, groups: &[usize]) -> Result<Vec<Vec<f32>>> {
        let cols = x.cols;
        let mut at = 0;
        let mut out = Vec::with_capacity(groups.len());
        for &g in groups {
            let end = (at + g) * cols;
            if end > x.data.len() {
                return Err(shape_err(format!(
                    "rows_to_host: {} rows asked of {}",
                    at + g,
                    x.rows
                )));
            }
            out.push(x.data[at * cols..end].to_vec());
            at += g;
        }
        Ok(out)
    }

    fn argmax(&self, logits: &TapeTensor) -> Result<Vec<u32>> {
        Ok(logits
            .data
            .chunks_exact(logits.cols.max(1))
            .map(|row| {
                let mut best = 0;
                for (i, &v) in row.iter().enumerate() {
                    if v > row[best] {
                        best = i;
                    }
                }
                best as u32
            })
            .collect())
    }

    fn masked_argmax(&self, logits: &TapeTensor, masks: &[Option<Vec<u32>>]) -> Result<Vec<u32>> {
        let _ = masks;
        let _ = logits;
        Err(unsupported("a masked argmax"))
    }

    fn embed_ids(&self, table: &TapeMatrix, ids: &Vec<u32>) -> Result<TapeTensor> {
        self.embed(table, ids)
    }

    fn ids_to_host(&self, ids: &Vec<u32>) -> Result<Vec<u32>> {
        Ok(ids.clone())
    }

    fn rope_table(&self, positions: &[usize], spec: &RopeSpec) -> Result<Arc<TapeRope>> {
        let fwd = CpuRope::new(positions, spec);
        let mut back = fwd.clone();
        back.sin.iter_mut().for_each(|s| *s = -*s);
        // The inverse of a scaled rotation (YaRN's attention factor f) is the rotation
        // by −θ scaled by f as well: the backward of y = f·R(θ)x is f·R(−θ)·dy, the
        // transpose, which is what the negated sines give.
        Ok(Arc::new(TapeRope { fwd, back }))
    }

    fn rope(&self, x: &TapeTensor, heads: usize, table: &Arc<TapeRope>) -> Result<TapeTensor> {
        let half = table.fwd.dims / 2;
        if half == 0 || table.fwd.cos.len() / half != x.rows || !x.cols.is_multiple_of(heads.max(1))
        {
            return Err(shape_err(format!(
                "rope: {}x{} in {heads} heads for {} positions",
                x.rows,
                x.cols,
                table.fwd.cos.len() / half.max(1)
            )));
        }
        let mut y = x.data.to_vec();
        table.fwd.apply(&mut y, heads);
        Ok(match x.node {
            Some(xn) => self.out(y, x.rows, x.cols, true, || Op::Rope {
                x: xn,
                heads,
                table: table.clone(),
            }),
            None => TapeTensor::leaf(y, x.rows, x.cols),
        })
    }

    fn new_kv_layer(&self, kv_heads: usize, head_dim: usize, window: Option<usize>) -> TapeKvLayer {
        TapeKvLayer {
            kv_heads,
            head_dim,
            window,
            len: 0,
            shared: None,
            lease: None,
        }
    }

    fn kv_layer_from_snapshot(&self, s: &KvLayerSnapshot) -> Result<TapeKvLayer> {
        if s.len != 0 {
            return Err(unsupported("a cache restored from a snapshot"));
        }
        Ok(self.new_kv_layer(s.kv_heads, s.head_dim, s.window))
    }

    fn new_delta_state(&self, shape: &DeltaShape) -> DeltaState {
        DeltaState::new(shape)
    }

    fn delta_state_from_host(&self, s: DeltaState) -> Result<DeltaState> {
        Ok(s)
    }

    /// The mixer of each sequence from its own state ([`deltanet`]), recorded where any
    /// of the four projections is tracked; each state moves past the sequence's rows.
    fn delta_net(
        &self,
        p: &crate::backend::DeltaParams<'_>,
        _uploaded: Option<&crate::backend::DeltaTensors<TapeTensor>>,
        x: crate::backend::DeltaInputs<'_, TapeTensor>,
        segments: &mut [crate::backend::DeltaSegment<'_, DeltaState>],
    ) -> Result<TapeTensor> {
        let sh = p.shape;
        let (cd, vd, vh) = (sh.conv_dim(), sh.v_heads * sh.v_dim, sh.v_heads);
        let n = x.qkv.rows;
        let ok = |t: &TapeTensor, cols: usize| t.rows == n && t.cols == cols;
        if !(ok(x.qkv, cd) && ok(x.z, vd) && ok(x.b, vh) && ok(x.a, vh))
            || sh.k_heads == 0
            || !sh.v_heads.is_multiple_of(sh.k_heads)
            || sh.conv_kernel == 0
            || p.conv.len() != cd * sh.conv_kernel
            || p.neg_a.len() != vh
            || p.dt_bias.len() != vh
            || p.norm.len() != sh.v_dim
        {
            return Err(shape_err(format!(
                "delta_net: qkv {}x{}, z {}x{}, b {}x{}, a {}x{} for {sh:?}",
                x.qkv.rows, x.qkv.cols, x.z.rows, x.z.cols, x.b.rows, x.b.cols, x.a.rows, x.a.cols
            )));
        }
        let mixer = deltanet::Mixer::of(p);
        let inputs = deltanet::Inputs {
            qkv: &x.qkv.data,
            z: &x.z.data,
            b: &x.b.data,
            a: &x.a.data,
        };
        let mut out = Vec::with_capacity(n * vd);
        let mut recorded = Vec::with_capacity(segments.len());
        let mut at = 0;
        for seg in segments.iter_mut() {
            if seg.rows.start != at || seg.rows.end > n {
                return Err(shape_err(format!(
                    "delta_net: segment rows {:?} after row {at} of {n}",
                    seg.rows
                )));
            }
            at = seg.rows.end;
            let st = &mut *seg.state;
            if st.conv.len() != sh.conv_state_len() || st.ssm.len() != sh.ssm_state_len() {
                return Err(shape_err(format!(
                    "delta_net: a state of {} + {} values for {sh:?}",
                    st.conv.len(),
                    st.ssm.len()
                )));
            }
            let nonzero = |v: &Vec<f32>| v.iter().any(|&x| x != 0.0).then(|| v.clone());
            let start = deltanet::Segment {
                rows: seg.rows.clone(),
                conv: nonzero(&st.conv),
                ssm: nonzero(&st.ssm),
            };
            let (o, conv, ssm) = deltanet::forward(&mixer, inputs, &start);
            out.extend(o);
            st.conv = conv;
            st.ssm = ssm;
            recorded.push(start);
        }
        if at != n {
            return Err(shape_err(format!(
                "delta_net: segments cover {at} of {n} rows"
            )));
        }
        let nodes = [x.qkv.node, x.z.node, x.b.node, x.a.node];
        let tracked = nodes.iter().any(Option::is_some);
        Ok(self.out(out, n, vd, tracked, || Op::DeltaNet {
            inputs: nodes,
            vals: [
                x.qkv.data.clone(),
                x.z.data.clone(),
                x.b.data.clone(),
                x.a.data.clone(),
            ],
            mixer: Box::new(mixer),
            segments: recorded,
        }))
    }

    /// The experts on the host's routing, recorded: the routing weights as a function of
    /// the router's logits (softmax, the top `k` renormalised, times each expert's scale;
    /// which experts are picked is piecewise constant and carries no gradient), and each
    /// expert's gated MLP on the rows routed to it through the recorded ops, weighted and
    /// added at those rows.
    fn moe(
        &self,
        experts: &crate::backend::Experts<Self>,
        x: &TapeTensor,
        logits: &TapeTensor,
        rows: usize,
    ) -> Result<TapeTensor> {
        self.moe_with_deltas(experts, x, logits, rows, &LoraBatch::empty(), 0)
    }

    /// [`TapeBackend::moe`] with `lora`'s deltas beside each expert's two products at the
    /// rows whose adapters have them, recorded like the products (the factors get
    /// gradients as a linear layer's do).
    fn moe_with_deltas(
        &self,
        experts: &crate::backend::Experts<Self>,
        x: &TapeTensor,
        logits: &TapeTensor,
        rows: usize,
        lora: &LoraBatch<'_, Self>,
        layer: usize,
    ) -> Result<TapeTensor> {
        let (n, k, h) = (experts.len(), experts.top_k(), experts.hidden());
        if logits.rows != rows || logits.cols != n || x.rows != rows || x.cols != h {
            return Err(shape_err(format!(
                "moe: x {}x{}, logits {}x{} for {rows} rows, {n} experts of width {h}",
                x.rows, x.cols, logits.rows, logits.cols
            )));
        }
        let scale = experts.per_expert_scale();
        let routing = Routing::softmax_top_k(&logits.data, n, k, scale)?;
        experts.check(&routing)?;
        let weights = self.route_weights(logits, &routing, scale);
        let mut out = TapeTensor::leaf(vec![0.0; rows * h], rows, h);
        for e in 0..n {
            let slots: Vec<usize> = (0..routing.experts.len())
                .filter(|&s| routing.experts[s] == e)
                .collect();
            if slots.is_empty() {
                continue;
            }
            let picked: Vec<usize> = slots.iter().map(|&s| s / k).collect();
            let xs = self.select_rows(x, &picked)?;
            let y = experts.expert_with_deltas(self, &xs, e, &picked, lora, layer)?;
            let y = self.weighted_rows(&y, &weights, &slots)?;
            out = self.add_rows(&out, &picked, &y)?;
        }
        Ok(out)
    }

    fn sigmoid_gate(
        &self,
        x: &TapeTensor,
        gate: &TapeTensor,
        shape: (usize, usize),
    ) -> Result<TapeTensor> {
        let (rows, cols) = shape;
        if x.rows != rows || x.cols != cols {
            return Err(shape_err(format!(
                "sigmoid_gate: {}x{} for {rows}x{cols}",
                x.rows, x.cols
            )));
        }
        Self::check_same("sigmoid_gate", x, gate)?;
        let y: Vec<f32> = x
            .data
            .iter()
            .zip(gate.data.iter())
            .map(|(&v, &g)| v / (1.0 + (-g).exp()))
            .collect();
        let (xn, gn) = (x.node, gate.node);
        Ok(self.out(y, rows, cols, xn.is_some() || gn.is_some(), || {
            Op::SigmoidGate {
                x: xn,
                gate: gn,
                x_val: x.data.clone(),
                gate_val: gate.data.clone(),
            }
        }))
    }

    fn attention(
        &self,
        q: &TapeTensor,
        k: &TapeTensor,
        v: &TapeTensor,
        segments: &mut [AttentionSegment<'_, TapeKvLayer>],
        params: &AttentionParams,
    ) -> Result<TapeTensor> {
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(segments.len());
        for seg in segments.iter() {
            if !seg.cache.is_empty() {
                return Err(unsupported(
                    "attention over cached tokens (training passes run whole sequences from an empty cache)",
                ));
            }
            ranges.push(seg.rows.clone());
        }
        let out = self.attend(q, k, v, ranges, params)?;
        for seg in segments.iter_mut() {
            seg.cache.len = seg.rows.len();
        }
        Ok(out)
    }

    /// Attention whose keys and values may come from an earlier layer of the pass (Gemma
    /// 4's KV sharing): a producing layer read later (`evict` false) keeps its `k` and `v`
    /// in the cache, tape nodes and all, and a reading layer (`new_kv` `None`) attends to
    /// them, so its gradient reaches the producer's projections through them.
    fn attention_shared(
        &self,
        q: &TapeTensor,
        new_kv: Option<(&TapeTensor, &TapeTensor)>,
        segments: &mut [AttentionSegment<'_, TapeKvLayer>],
        params: &AttentionParams,
        evict: bool,
        ends: Option<&[usize]>,
    ) -> Result<TapeTensor> {
        if ends.is_some() {
            return Err(unsupported("bidirectional attention over media"));
        }
        if let Some((k, v)) = new_kv {
            let out = self.attention(q, k, v, segments, params)?;
            if !evict {
                for seg in segments.iter_mut() {
                    seg.cache.shared = Some(SharedKv {
                        k: k.clone(),
                        v: v.clone(),
                        rows: seg.rows.clone(),
                    });
                }
            }
            return Ok(out);
        }
        let mut kv: Option<(TapeTensor, TapeTensor)> = None;
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(segments.len());
        for seg in segments.iter() {
            let Some(s) = &seg.cache.shared else {
                return Err(unsupported(
                    "a layer reading a shared cache that holds no keys of this pass",
                ));
            };
            if s.rows != seg.rows || seg.cache.len != seg.rows.len() {
                return Err(shape_err(format!(
                    "attention: rows {:?} read a shared cache of rows {:?}",
                    seg.rows, s.rows
                )));
            }
            match &kv {
                None => kv = Some((s.k.clone(), s.v.clone())),
                Some((k, _)) if Arc::ptr_eq(&k.data, &s.k.data) => {}
                Some(_) => {
                    return Err(unsupported(
                        "sequences of one pass reading keys of different passes",
                    ))
                }
            }
            ranges.push(seg.rows.clone());
        }
        let Some((k, v)) = kv else {
            return Err(shape_err("attention over no sequence".into()));
        };
        let out = self.attend(q, &k, &v, ranges, params)?;
        if evict {
            for seg in segments.iter_mut() {
                seg.cache.shared = None;
            }
        }
        Ok(out)
    }

    fn low_rank_add(
        &self,
        x: &TapeTensor,
        ys: Vec<TapeTensor>,
        deltas: &[&[LowRankDelta<'_, Self>]],
    ) -> Result<Vec<TapeTensor>> {
        ys.into_iter()
            .zip(deltas)
            .map(|(mut y, ds)| {
                for d in ds.iter() {
                    let xs = if d.all {
                        x.clone()
                    } else {
                        self.select_rows(x, d.rows)?
                    };
                    let xs = self.lora_input(&xs, d.a);
                    let t = self.linear(&xs, d.a, None)?;
                    y = if d.all {
                        self.linear_add(y, &t, d.b)?
                    } else {
                        let delta = self.linear(&t, d.b, None)?;
                        self.add_rows(&y, d.rows, &delta)?
                    };
                }
                Ok(y)
            })
            .collect()
    }

    fn add_rows(&self, y: &TapeTensor, rows: &[usize], d: &TapeTensor) -> Result<TapeTensor> {
        let cols = y.cols;
        if d.cols != cols || d.rows != rows.len() {
            return Err(shape_err(format!(
                "add_rows: {}x{} at {} rows of width {cols}",
                d.rows,
                d.cols,
                rows.len()
            )));
        }
        let mut out = y.data.to_vec();
        for (i, &r) in rows.iter().enumerate() {
            if r >= y.rows {
                return Err(shape_err(format!("add_rows: row {r} of {}", y.rows)));
            }
            out[r * cols..(r + 1) * cols]
                .iter_mut()
                .zip(&d.data[i * cols..(i + 1) * cols])
                .for_each(|(a, b)| *a += b);
        }
        let (yn, dn) = (y.node, d.node);
        Ok(
            self.out(out, y.rows, cols, yn.is_some() || dn.is_some(), || {
                Op::AddRows {
                    y: yn,
                    d: dn,
                    rows: rows.to_vec(),
                    cols,
                }
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROWS: usize = 7;
    const IN: usize = 6;
    const HD: usize = 4;

    /// `n` pseudo-random values in [-0.5, 0.5) from `seed` (xorshift).
    pub(super) fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                s as f32 / u32::MAX as f32 - 0.5
            })
            .collect()
    }

    /// `analytic` against the central difference of `loss(bump)` at ±10⁻³ (within 10⁻³ of
    /// the numeric value, relative above 1).
    fn assert_central_difference(what: &str, analytic: f32, loss: impl Fn(f32) -> f64) {
        let eps = 1e-3f32;
        let numeric = (loss(eps) - loss(-eps)) / (2.0 * f64::from(eps));
        let analytic = f64::from(analytic);
        assert!(
            (numeric - analytic).abs() <= 1e-3 * numeric.abs().max(1.0),
            "{what}: numeric {numeric} analytic {analytic}"
        );
    }

    /// Two layers of one pass, the second attending to the first's keys and values (a
    /// KV-shared Gemma 4 layer), over two packed sequences with a sliding window:
    /// `Σ r ⊙ (attn₁ + attn₂)` and the gradients of the four projections (K, V and each
    /// layer's Q). `second`: whether the reading layer runs at all.
    fn shared_pass(
        be: &TapeBackend,
        w: &[Vec<f32>; 4],
        r: &[f32],
        second: bool,
    ) -> (f64, ParamGrads) {
        let params = AttentionParams {
            heads: 2,
            kv_heads: 1,
            head_dim: HD,
            scale: 0.5,
            window: Some(3),
            softcap: None,
        };
        let shapes = [(HD, 0), (HD, 1), (2 * HD, 2), (2 * HD, 3)];
        let m: Vec<TapeMatrix> = shapes
            .iter()
            .map(|&(rows, id)| be.parameter(id, w[id].clone(), rows, IN, None).unwrap())
            .collect();
        be.set_recording(true);
        let x = TapeTensor::leaf(values(ROWS * IN, 1), ROWS, IN);
        let ones = TapeTensor::leaf(vec![1.0; HD], 1, HD);
        let (mut c0, mut c1) = (
            be.new_kv_layer(1, HD, Some(3)),
            be.new_kv_layer(1, HD, Some(3)),
        );
        let k = be.linear(&x, &m[0], None).unwrap();
        let v = be.linear(&x, &m[1], None).unwrap();
        let v = be.rms_norm(&v, &ones, 1e-6).unwrap();
        let mut y = {
            let mut segs = [
                AttentionSegment {
                    rows: 0..4,
                    cache: &mut c0,
                },
                AttentionSegment {
                    rows: 4..ROWS,
                    cache: &mut c1,
                },
            ];
            let q = be.linear(&x, &m[2], None).unwrap();
            be.attention_shared(&q, Some((&k, &v)), &mut segs, &params, !second, None)
                .unwrap()
        };
        if second {
            let mut segs = [
                AttentionSegment {
                    rows: 0..4,
                    cache: &mut c0,
                },
                AttentionSegment {
                    rows: 4..ROWS,
                    cache: &mut c1,
                },
            ];
            let q = be.linear(&x, &m[3], None).unwrap();
            let a = be
                .attention_shared(&q, None, &mut segs, &params, true, None)
                .unwrap();
            y = be.add(&y, &a).unwrap();
        }
        // The last reader let the keys go.
        assert!(c0.shared.is_none() && c1.shared.is_none());
        let loss = y
            .data()
            .iter()
            .zip(r)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        let grads = be.backward(&y.grad_root(), r.to_vec()).unwrap();
        (loss, grads)
    }

    /// The gradient through keys and values a later layer reads against central
    /// differences, and the reading layer's share of it is there.
    #[test]
    fn shared_keys_and_values_carry_the_readers_gradient() {
        let be = TapeBackend::new(false);
        let w: [Vec<f32>; 4] = [
            values(HD * IN, 2),
            values(HD * IN, 3),
            values(2 * HD * IN, 4),
            values(2 * HD * IN, 5),
        ];
        let r = values(ROWS * 2 * HD, 6);
        let (_, grads) = shared_pass(&be, &w, &r, true);
        for id in 0..4 {
            let g = &grads[&id];
            for idx in [0, 5, 13, 20] {
                assert_central_difference(&format!("parameter {id}[{idx}]"), g[idx], |d| {
                    let mut w = w.clone();
                    w[id][idx] += d;
                    shared_pass(&be, &w, &r, true).0
                });
            }
        }
        let (_, alone) = shared_pass(&be, &w, &r, false);
        for id in [0, 1] {
            let diff = grads[&id]
                .iter()
                .zip(&alone[&id])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(diff > 1e-3, "the reader adds only {diff} to parameter {id}");
        }
    }

    /// `Σ r ⊙ (x·P₀ᵀ · σ(x·P₁ᵀ))` (an attention output gate): both projections'
    /// gradients against central differences.
    #[test]
    fn sigmoid_gate_backward_matches_finite_differences() {
        let be = TapeBackend::new(false);
        let x = TapeTensor::leaf(values(ROWS * IN, 21), ROWS, IN);
        let r = values(ROWS * HD, 22);
        let w = [values(HD * IN, 23), values(HD * IN, 24)];
        let run = |w: &[Vec<f32>; 2]| -> (f64, ParamGrads) {
            be.set_recording(true);
            let m: Vec<TapeMatrix> = (0..2)
                .map(|id| be.parameter(id, w[id].clone(), HD, IN, None).unwrap())
                .collect();
            let a = be.linear(&x, &m[0], None).unwrap();
            let g = be.linear(&x, &m[1], None).unwrap();
            let y = be.sigmoid_gate(&a, &g, (ROWS, HD)).unwrap();
            let loss = y
                .data()
                .iter()
                .zip(&r)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            (loss, be.backward(&y.grad_root(), r.clone()).unwrap())
        };
        let (_, grads) = run(&w);
        for id in 0..2 {
            for idx in [0, 7, 13, HD * IN - 1] {
                assert_central_difference(
                    &format!("parameter {id}[{idx}]"),
                    grads[&id][idx],
                    |d| {
                        let mut w = w.clone();
                        w[id][idx] += d;
                        run(&w).0
                    },
                );
            }
        }
    }

    /// Experts with a delta beside each expert's two products (PEFT's `target_parameters`),
    /// on two adapters' rows and base rows: the forward equals the CPU backend's host path
    /// with the same deltas, and `Σ r ⊙ moe(x)`'s gradients of the factors match central
    /// differences (only the factors of the adapter on the rows are nonzero).
    #[test]
    fn expert_deltas_forward_as_served_and_backward_to_their_factors() {
        use crate::adapters::{ExpertPart, LoraWeights, Target};
        use crate::backend::candle::CandleBackend;
        use crate::backend::{Activation, Experts};
        let (n, h, i, rows, k, rank) = (4, 6, 5, 9, 2, 2);
        let host = |name: &str, shape: Vec<usize>, v: &[f32]| HostWeight {
            name: name.into(),
            dtype: GgmlType::F32,
            shape,
            bytes: Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        };
        let gu = host("gate_up", vec![n, 2 * i, h], &values(n * 2 * i * h, 31));
        let down = host("down", vec![n, h, i], &values(n * h * i, 32));
        let scale = vec![1.0, 0.8, 1.2, 0.9];
        let x = values(rows * h, 33);
        let logits = values(rows * n, 34);
        let r = values(rows * h, 35);
        // Per adapter, part and expert: A [rank, in] then B [out, rank] (ids as `id_of`).
        let shapes = [(rank, h, 2 * i, rank), (rank, i, h, rank)];
        let factors: Vec<Vec<f32>> = (0..2 * 2 * n * 2)
            .map(|id| {
                let ((ar, ac, br, bc), which) = (shapes[(id / (2 * n)) % 2], id % 2);
                let len = if which == 0 { ar * ac } else { br * bc };
                values(len, 40 + id as u32)
            })
            .collect();
        // id = ((adapter · 2 + part) · n + e) · 2 + which
        let id_of =
            |ad: usize, part: usize, e: usize, which: usize| ((ad * 2 + part) * n + e) * 2 + which;
        // Rows 0..4 use adapter 0, 4..7 adapter 1, 7..9 none.
        let ranges = [0..4, 4..7, 7..9];
        // Adapter `ad`'s factors, `f(ad, part, e, which)`, mounted as one adapter.
        fn mount<B: Backend>(
            f: &dyn Fn(usize, usize, usize, usize) -> Result<B::Matrix>,
            ad: usize,
            n: usize,
        ) -> LoraWeights<B> {
            let slots: [Option<(B::Matrix, B::Matrix)>; Target::COUNT] =
                std::array::from_fn(|_| None);
            let mut w = LoraWeights::from_matrices(vec![slots]);
            for (p, part) in [ExpertPart::GateUp, ExpertPart::Down]
                .into_iter()
                .enumerate()
            {
                let pairs = (0..n)
                    .map(|e| (f(ad, p, e, 0).unwrap(), f(ad, p, e, 1).unwrap()))
                    .collect();
                w = w.with_expert_pairs(0, part, pairs).unwrap();
            }
            w
        }
        let dims = |p: usize, which: usize| {
            let (ar, ac, br, bc) = shapes[p];
            if which == 0 {
                (ar, ac)
            } else {
                (br, bc)
            }
        };
        let run = |fs: &[Vec<f32>]| -> (Vec<f32>, f64, ParamGrads) {
            let be = TapeBackend::new(false);
            be.set_recording(true);
            let (experts, _) =
                Experts::upload(&be, &gu, &down, scale.clone(), k, Activation::Silu).unwrap();
            let param = |ad: usize, p: usize, e: usize, which: usize| {
                let id = id_of(ad, p, e, which);
                let (rr, cc) = dims(p, which);
                be.parameter(id, fs[id].clone(), rr, cc, None)
            };
            let w0 = mount(&param, 0, n);
            let w1 = mount(&param, 1, n);
            let batch = LoraBatch::new(&[vec![&w0], vec![&w1]], &ranges);
            let xt = TapeTensor::leaf(x.clone(), rows, h);
            let lt = TapeTensor::leaf(logits.clone(), rows, n);
            let y = be
                .moe_with_deltas(&experts, &xt, &lt, rows, &batch, 0)
                .unwrap();
            let loss = y
                .data()
                .iter()
                .zip(&r)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            let grads = be.backward(&y.grad_root(), r.clone()).unwrap();
            (y.data().to_vec(), loss, grads)
        };
        let (got, _, grads) = run(&factors);
        // The serving path (the CPU backend, routing on the host) gives the same rows.
        let cpu = CandleBackend::cpu();
        let (experts, _) =
            Experts::upload(&cpu, &gu, &down, scale.clone(), k, Activation::Silu).unwrap();
        let upload = |ad: usize, p: usize, e: usize, which: usize| {
            let (rr, cc) = dims(p, which);
            let v = &factors[id_of(ad, p, e, which)];
            cpu.matrix(host("f", vec![rr, cc], v))
        };
        let (c0, c1) = (mount(&upload, 0, n), mount(&upload, 1, n));
        let batch = LoraBatch::new(&[vec![&c0], vec![&c1]], &ranges);
        let xc = cpu.tensor_from_host(x.clone(), rows, h).unwrap();
        let lc = cpu.tensor_from_host(logits.clone(), rows, n).unwrap();
        let want = cpu
            .moe_with_deltas(&experts, &xc, &lc, rows, &batch, 0)
            .unwrap();
        let want = cpu.rows_to_host(&want, &[rows]).unwrap().concat();
        let plain = cpu.moe(&experts, &xc, &lc, rows).unwrap();
        let plain = cpu.rows_to_host(&plain, &[rows]).unwrap().concat();
        for (j, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() < 1e-5, "output {j}: tape {a}, cpu {b}");
        }
        let moved = got
            .iter()
            .zip(&plain)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(moved > 1e-2, "the deltas move the output by only {moved}");
        // Rows without an adapter are the base experts' output.
        for j in 7 * h..rows * h {
            assert!((got[j] - plain[j]).abs() < 1e-5, "base row value {j}");
        }
        let mut checked = 0;
        for (id, f) in factors.iter().enumerate() {
            let Some(g) = grads.get(&id) else { continue };
            for idx in [0, f.len() / 2, f.len() - 1] {
                assert_central_difference(&format!("factor {id}[{idx}]"), g[idx], |d| {
                    let mut fs = factors.clone();
                    fs[id][idx] += d;
                    run(&fs).1
                });
                checked += 1;
            }
        }
        // Every expert some row of an adapter picked has gradients on both parts.
        assert!(
            checked >= 2 * 2 * 2 * 3,
            "only {checked} factor values had gradients"
        );
    }

    /// A layer reading a shared cache nothing filled is refused, not attended to nothing.
    #[test]
    fn reading_an_unfilled_shared_cache_is_an_error() {
        let be = TapeBackend::new(false);
        let params = AttentionParams {
            heads: 1,
            kv_heads: 1,
            head_dim: HD,
            scale: 1.0,
            window: None,
            softcap: None,
        };
        let q = TapeTensor::leaf(values(3 * HD, 9), 3, HD);
        let mut c = be.new_kv_layer(1, HD, None);
        let mut segs = [AttentionSegment {
            rows: 0..3,
            cache: &mut c,
        }];
        assert!(be
            .attention_shared(&q, None, &mut segs, &params, true, None)
            .is_err());
    }
}
