//! The training loop: examples in a seeded order, micro-batches accumulated into one
//! optimizer step, clipping, AdamW under the schedule, validation, checkpoints, and an
//! event per step for whoever shows progress (the CLI's bar, an HTTP job's stream).
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::json;

use crate::adapter_io::{self, TrainerState};
use crate::base::BaseWeights;
use crate::data::{Dataset, Example, Sequence};
use crate::decoder::{AdapterRef, Batch, Dropout, TrainDecoder};
use crate::error::{io, Result, TrainError};
use crate::lora::{LoraConfig, LoraParams};
use crate::loss::{self, Method};
use crate::optim::{clip_global_norm, AdamW, AdamWConfig, Schedule};

/// Everything a run is configured by.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// The objective.
    pub method: Method,
    /// Optimizer steps.
    pub iters: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Learning-rate schedule.
    pub schedule: Schedule,
    /// Warm-up steps.
    pub warmup: usize,
    /// Examples per micro-batch.
    pub batch: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Global-norm clip (0: off).
    pub grad_clip: f32,
    /// Seed of the factor initialization and the data order.
    pub seed: u64,
    /// Longest sequence.
    pub max_seq: usize,
    /// Validation examples (at most).
    pub val_size: usize,
    /// Steps between validations (0: only at the end).
    pub eval_every: usize,
    /// Steps between checkpoints (0: none).
    pub save_every: usize,
    /// The adapter's layout.
    pub lora: LoraConfig,
    /// AdamW's hyperparameters.
    pub adam: AdamWConfig,
    /// Gradient checkpointing: keep each layer's input only and recompute the layer in
    /// the backward.
    pub grad_checkpoint: bool,
}

impl TrainConfig {
    /// The reference's defaults for `method`: SFT lr 2e-4, DPO 5e-5, ORPO 1e-5; 100
    /// iterations of batch 1; rank 8, scale 1; cosine without warm-up; clip 1.0.
    pub fn defaults(method: Method) -> TrainConfig {
        TrainConfig {
            method,
            iters: 100,
            lr: match method {
                Method::Sft => 2e-4,
                Method::Dpo { .. } => 5e-5,
                Method::Orpo { .. } => 1e-5,
            },
            schedule: Schedule::Cosine,
            warmup: 0,
            batch: 1,
            grad_accum: 1,
            grad_clip: 1.0,
            seed: 0,
            max_seq: 512,
            val_size: 256,
            eval_every: 50,
            save_every: 0,
            lora: LoraConfig::default(),
            adam: AdamWConfig::default(),
            grad_checkpoint: false,
        }
    }

    /// Checks the ranges.
    pub fn validate(&self) -> Result<()> {
        self.lora.validate()?;
        let bad = |m: &str| Err(TrainError::Config(m.into()));
        if self.iters == 0 {
            return bad("--iters must be at least 1");
        }
        if self.batch == 0 || self.grad_accum == 0 {
            return bad("--batch and --grad-accum must be at least 1");
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("--lr must be a positive number");
        }
        if self.max_seq < 2 {
            return bad("--seq must be at least 2");
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return bad("--grad-clip must be 0 (off) or positive");
        }
        if !(self.adam.lora_plus_ratio.is_finite() && self.adam.lora_plus_ratio > 0.0) {
            return bad("--lora-plus-ratio must be positive");
        }
        match self.method {
            Method::Dpo { beta: b } | Method::Orpo { lambda: b } if !(b.is_finite() && b > 0.0) => {
                bad("--beta / --lambda must be positive")
            }
            _ => Ok(()),
        }
    }
}

/// What one optimizer step measured.
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    /// The step (1-based).
    pub step: usize,
    /// The loss of the step's examples.
    pub loss: f64,
    /// The learning rate used.
    pub lr: f32,
    /// Tokens through the forward passes.
    pub tokens: usize,
    /// Gradient norm before clipping.
    pub grad_norm: f32,
    /// DPO/ORPO: fraction of pairs whose chosen reward beats the rejected one.
    pub accuracy: Option<f64>,
    /// DPO/ORPO: mean reward margin.
    pub margin: Option<f64>,
}

/// A validation pass.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalStats {
    /// After this step.
    pub step: usize,
    /// The mean loss.
    pub loss: f64,
    /// DPO/ORPO reward accuracy.
    pub accuracy: Option<f64>,
    /// DPO/ORPO reward margin.
    pub margin: Option<f64>,
}

/// What the loop reports as it goes.
#[derive(Debug, Clone)]
pub enum Event {
    /// An optimizer step finished.
    Step {
        /// Its numbers.
        stats: StepStats,
        /// Tokens per second since the run (or resume) started.
        tokens_per_s: f64,
    },
    /// A validation pass finished.
    Eval(EvalStats),
    /// A checkpoint was written.
    Saved(PathBuf),
}

/// Loss, gradient and logged numbers of a set of micro-batches.
struct Accumulated {
    loss: f64,
    tokens: usize,
    correct: usize,
    margin: f64,
    pairs: usize,
}

/// A training run over one base.
pub struct Trainer<'a> {
    base: &'a BaseWeights,
    decoder: TrainDecoder<'a>,
    /// The run's configuration.
    pub config: TrainConfig,
    /// The factors being trained.
    pub params: LoraParams,
    /// The optimizer.
    pub opt: AdamW,
    /// Optimizer steps taken.
    pub step: usize,
}

impl<'a> Trainer<'a> {
    /// Fresh factors (PEFT's initialization from the seed) over `base`.
    pub fn new(base: &'a BaseWeights, config: TrainConfig) -> Result<Trainer<'a>> {
        config.validate()?;
        let params = LoraParams::init(&base.cfg, &config.lora, config.seed);
        let opt = AdamW::new(config.adam, &params);
        Ok(Trainer {
            base,
            decoder: TrainDecoder::new(base, config.max_seq)
                .with_checkpointing(config.grad_checkpoint),
            config,
            params,
            opt,
            step: 0,
        })
    }

    /// Continues from a checkpoint directory (or an output directory holding
    /// `checkpoints/`): factors, optimizer moments and step.
    pub fn resume(&mut self, dir: &Path) -> Result<PathBuf> {
        let found = adapter_io::latest_checkpoint(dir).ok_or_else(|| TrainError::Resume {
            path: dir.to_path_buf(),
            reason: "no checkpoint (trainer_state.json) there or under checkpoints/".into(),
        })?;
        let ck = adapter_io::load_checkpoint(&found, &self.params, &self.config.lora)?;
        self.params = ck.params;
        self.opt.m = ck.m;
        self.opt.v = ck.v;
        self.opt.step = ck.adam_step;
        self.step = ck.step as usize;
        Ok(found)
    }

    /// The adapter of micro-batch `micro` of the current step; `train`: with its
    /// dropout (evaluation runs without).
    fn adapter(&self, micro: usize, train: bool) -> AdapterRef<'_> {
        let c = &self.config;
        let dropout = train
            .then(|| Dropout::new(c.lora.dropout, c.seed, self.step as u64, micro as u64))
            .flatten();
        AdapterRef::new(&self.params, c.lora.multiplier()).with_dropout(dropout)
    }

    /// Loss and (when `grads` is given) its gradient over `micro` (each one micro-batch),
    /// normalized over all of them together.
    fn accumulate(
        &self,
        micro: &[Vec<&Example>],
        mut grads: Option<&mut LoraParams>,
    ) -> Result<Accumulated> {
        let mut acc = Accumulated {
            loss: 0.0,
            tokens: 0,
            correct: 0,
            margin: 0.0,
            pairs: 0,
        };
        let all = || micro.iter().flat_map(|m| m.iter().copied());
        match self.config.method {
            Method::Sft => {
                let n: usize = all()
                    .map(|e| match e {
                        Example::Sft(s) => s.response_len(),
                        Example::Pair { .. } => 0,
                    })
                    .sum();
                let w = 1.0 / n.max(1) as f32;
                for (mi, m) in micro.iter().enumerate() {
                    let adapter = self.adapter(mi, grads.is_some());
                    let mut batch = Batch::new();
                    for &e in m {
                        if let Example::Sft(s) = e {
                            push_response(&mut batch, s);
                        }
                    }
                    acc.tokens += batch.rows();
                    let fwd = self.decoder.forward(Some(adapter), &batch)?;
                    acc.loss -= fwd.logp.iter().map(|&l| f64::from(l)).sum::<f64>() * f64::from(w);
                    if let Some(g) = grads.as_deref_mut() {
                        let dlogp = vec![-w; fwd.logp.len()];
                        self.decoder.backward(adapter, &batch, fwd, &dlogp, g)?;
                    }
                }
            }
            Method::Dpo { beta } => {
                let pairs = all().count().max(1) as f64;
                for (mi, m) in micro.iter().enumerate() {
                    let adapter = self.adapter(mi, grads.is_some());
                    let (batch, spans) = pair_batch(m, false);
                    acc.tokens += batch.rows();
                    let reference = self.decoder.logp(None, &batch)?;
                    let fwd = self.decoder.forward(Some(adapter), &batch)?;
                    let sum = |lp: &[f32], r: &std::ops::Range<usize>| {
                        lp[r.clone()].iter().map(|&v| f64::from(v)).sum::<f64>()
                    };
                    let mut dlogp = vec![0.0f32; fwd.logp.len()];
                    for (c, r) in &spans {
                        let t = loss::dpo(
                            f64::from(beta),
                            sum(&fwd.logp, c),
                            sum(&fwd.logp, r),
                            sum(&reference, c),
                            sum(&reference, r),
                        );
                        acc.loss += t.loss / pairs;
                        acc.correct += usize::from(t.reward_chosen > t.reward_rejected);
                        acc.margin += t.reward_chosen - t.reward_rejected;
                        acc.pairs += 1;
                        dlogp[c.clone()].fill((t.d_chosen / pairs) as f32);
                        dlogp[r.clone()].fill((-t.d_chosen / pairs) as f32);
                    }
                    if let Some(g) = grads.as_deref_mut() {
                        self.decoder.backward(adapter, &batch, fwd, &dlogp, g)?;
                    }
                }
            }
            Method::Orpo { lambda } => {
                let pairs = all().count().max(1) as f64;
                let nll_tokens: usize = all()
                    .map(|e| match e {
                        Example::Pair { chosen, .. } => chosen.tokens.len().saturating_sub(1),
                        Example::Sft(_) => 0,
                    })
                    .sum();
                let wn = 1.0 / nll_tokens.max(1) as f64;
                for (mi, m) in micro.iter().enumerate() {
                    let adapter = self.adapter(mi, grads.is_some());
                    let (batch, spans) = pair_batch(m, true);
                    acc.tokens += batch.rows();
                    let fwd = self.decoder.forward(Some(adapter), &batch)?;
                    let mut dlogp = vec![0.0f32; fwd.logp.len()];
                    for ((c, r), &e) in spans.iter().zip(m.iter()) {
                        let Example::Pair { chosen, .. } = e else {
                            continue;
                        };
                        // Chosen targets are every position; its response is the tail.
                        let resp = c.end - chosen.response_len()..c.end;
                        let mean = |r: &std::ops::Range<usize>| {
                            fwd.logp[r.clone()]
                                .iter()
                                .map(|&v| f64::from(v))
                                .sum::<f64>()
                                / r.len().max(1) as f64
                        };
                        let (mc, mr) = (mean(&resp), mean(r));
                        let t = loss::orpo(f64::from(lambda), mc, mr);
                        let nll: f64 = fwd.logp[c.clone()].iter().map(|&v| f64::from(v)).sum();
                        acc.loss += t.loss / pairs - nll * wn;
                        let (rc, rr) = (f64::from(lambda) * mc, f64::from(lambda) * mr);
                        acc.correct += usize::from(rc > rr);
                        acc.margin += rc - rr;
                        acc.pairs += 1;
                        dlogp[c.clone()].fill(-wn as f32);
                        let dc = t.d_mean_chosen / pairs / resp.len().max(1) as f64;
                        dlogp[resp.clone()].iter_mut().for_each(|d| *d += dc as f32);
                        let dr = t.d_mean_rejected / pairs / r.len().max(1) as f64;
                        dlogp[r.clone()].fill(dr as f32);
                    }
                    if let Some(g) = grads.as_deref_mut() {
                        self.decoder.backward(adapter, &batch, fwd, &dlogp, g)?;
                    }
                }
            }
        }
        Ok(acc)
    }

    /// Loss and gradient of one optimizer step's micro-batches, without updating.
    pub fn loss_and_grads(&self, micro: &[Vec<&Example>]) -> Result<(f64, LoraParams)> {
        let mut grads = self.params.zeros_like();
        let acc = self.accumulate(micro, Some(&mut grads))?;
        Ok((acc.loss, grads))
    }

    /// One optimizer step over `micro`.
    pub fn train_step(&mut self, micro: &[Vec<&Example>]) -> Result<StepStats> {
        let mut grads = self.params.zeros_like();
        let acc = self.accumulate(micro, Some(&mut grads))?;
        let grad_norm = clip_global_norm(&mut grads, self.config.grad_clip);
        let c = &self.config;
        let lr = (f64::from(c.lr) * c.schedule.factor(self.step, c.warmup, c.iters)) as f32;
        self.opt.update(&mut self.params, &grads, lr);
        self.step += 1;
        let pref = c.method.is_preference() && acc.pairs > 0;
        Ok(StepStats {
            step: self.step,
            loss: acc.loss,
            lr,
            tokens: acc.tokens,
            grad_norm,
            accuracy: pref.then(|| acc.correct as f64 / acc.pairs as f64),
            margin: pref.then(|| acc.margin / acc.pairs as f64),
        })
    }

    /// The mean loss over `examples` (in micro-batches of the run's batch size).
    pub fn evaluate(&self, examples: &[Example]) -> Result<EvalStats> {
        let (mut loss, mut correct, mut margin, mut pairs, mut n) = (0.0, 0, 0.0, 0, 0);
        for chunk in examples.chunks(self.config.batch) {
            let acc = self.accumulate(&[chunk.iter().collect()], None)?;
            loss += acc.loss;
            correct += acc.correct;
            margin += acc.margin;
            pairs += acc.pairs;
            n += 1;
        }
        let pref = self.config.method.is_preference() && pairs > 0;
        Ok(EvalStats {
            step: self.step,
            loss: loss / n.max(1) as f64,
            accuracy: pref.then(|| correct as f64 / pairs as f64),
            margin: pref.then(|| margin / pairs as f64),
        })
    }

    /// The examples of optimizer step `step` (0-based): the `batch · grad_accum`
    /// examples after those of the steps before, epochs reshuffled from the seed.
    pub fn step_examples<'d>(&self, train: &'d [Example], step: usize) -> Vec<Vec<&'d Example>> {
        let c = &self.config;
        let per_step = c.batch * c.grad_accum;
        let n = train.len();
        let mut micro = Vec::with_capacity(c.grad_accum);
        let mut cur = Vec::with_capacity(c.batch);
        let mut epoch_order: Option<(usize, Vec<usize>)> = None;
        for k in step * per_step..(step + 1) * per_step {
            let (epoch, i) = (k / n, k % n);
            if epoch_order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                let mut order: Vec<usize> = (0..n).collect();
                let mut rng = rand::rngs::StdRng::seed_from_u64(
                    c.seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                );
                order.shuffle(&mut rng);
                epoch_order = Some((epoch, order));
            }
            let order = &epoch_order
                .as_ref()
                .map(|(_, o)| o)
                .unwrap_or_else(|| unreachable!());
            cur.push(&train[order[i]]);
            if cur.len() == c.batch {
                micro.push(std::mem::take(&mut cur));
            }
        }
        micro
    }

    /// Runs to `config.iters` steps, writing the adapter, `metrics.jsonl` and
    /// checkpoints into `out`. `cancel` stops it between steps (the adapter so far is
    /// saved first).
    pub fn run(
        &mut self,
        data: &Dataset,
        out: &Path,
        base_model: &str,
        cancel: &AtomicBool,
        mut on_event: impl FnMut(&Event),
    ) -> Result<()> {
        if data.train.is_empty() {
            return Err(TrainError::Config(
                "the dataset has no training example".into(),
            ));
        }
        std::fs::create_dir_all(out).map_err(io(out))?;
        let metrics_path = out.join("metrics.jsonl");
        // A fresh run starts the file over; a resumed one appends to it.
        let mut metrics = std::fs::OpenOptions::new()
            .create(true)
            .append(self.step > 0)
            .write(true)
            .truncate(self.step == 0)
            .open(&metrics_path)
            .map_err(io(&metrics_path))?;
        let mut log = |v: serde_json::Value| -> Result<()> {
            writeln!(metrics, "{v}").map_err(io(&metrics_path))
        };
        let valid = &data.valid[..data.valid.len().min(self.config.val_size)];
        let started = Instant::now();
        let mut tokens = 0usize;
        let layers = self.base.cfg.num_layers;
        while self.step < self.config.iters {
            if cancel.load(Ordering::Relaxed) {
                adapter_io::save_adapter(out, &self.params, &self.config.lora, layers, base_model)?;
                return Err(TrainError::Cancelled);
            }
            let micro = self.step_examples(&data.train, self.step);
            let stats = self.train_step(&micro)?;
            tokens += stats.tokens;
            let tokens_per_s = tokens as f64 / started.elapsed().as_secs_f64().max(1e-9);
            let mut line = json!({
                "step": stats.step, "loss": stats.loss, "lr": stats.lr, "tokens": stats.tokens,
                "tokens_per_s": tokens_per_s, "grad_norm": stats.grad_norm,
            });
            if let (Some(a), Some(m)) = (stats.accuracy, stats.margin) {
                line["accuracy"] = json!(a);
                line["margin"] = json!(m);
            }
            log(line)?;
            on_event(&Event::Step {
                stats: stats.clone(),
                tokens_per_s,
            });
            let last = self.step == self.config.iters;
            let c = &self.config;
            if !valid.is_empty()
                && (last || (c.eval_every > 0 && self.step.is_multiple_of(c.eval_every)))
            {
                let e = self.evaluate(valid)?;
                let mut line = json!({"step": e.step, "val_loss": e.loss});
                if let (Some(a), Some(m)) = (e.accuracy, e.margin) {
                    line["val_accuracy"] = json!(a);
                    line["val_margin"] = json!(m);
                }
                log(line)?;
                on_event(&Event::Eval(e));
            }
            if last || (c.save_every > 0 && self.step.is_multiple_of(c.save_every)) {
                let dir = out
                    .join("checkpoints")
                    .join(format!("step-{:06}", self.step));
                let state = TrainerState {
                    step: self.step as u64,
                    lora: c.lora.clone(),
                    seed: c.seed,
                    method: c.method.name().into(),
                };
                adapter_io::save_checkpoint(
                    &dir,
                    &self.params,
                    &self.opt,
                    &state,
                    layers,
                    base_model,
                )?;
                adapter_io::save_adapter(out, &self.params, &c.lora, layers, base_model)?;
                on_event(&Event::Saved(dir));
            }
        }
        Ok(())
    }
}

/// Adds an SFT sequence whose response tokens are the targets.
fn push_response(batch: &mut Batch, s: &Sequence) {
    let from = s.prompt_len.max(1);
    let labeled: Vec<bool> = (0..s.tokens.len()).map(|t| t >= from).collect();
    batch.push(&s.tokens, &labeled);
}

/// A batch of pairs (chosen, rejected, chosen, …) and each pair's target ranges.
/// `chosen_full`: the chosen sequence's targets are every position (ORPO's NLL).
type Spans = Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>;
fn pair_batch(examples: &[&Example], chosen_full: bool) -> (Batch, Spans) {
    let mut batch = Batch::new();
    let mut spans = Vec::new();
    for &e in examples {
        let Example::Pair { chosen, rejected } = e else {
            continue;
        };
        let c0 = batch.targets.len();
        if chosen_full {
            let labeled = vec![true; chosen.tokens.len()];
            batch.push(&chosen.tokens, &labeled);
        } else {
            push_response(&mut batch, chosen);
        }
        let r0 = batch.targets.len();
        push_response(&mut batch, rejected);
        spans.push((c0..r0, r0..batch.targets.len()));
    }
    (batch, spans)
}
