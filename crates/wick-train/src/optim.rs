//! AdamW as PyTorch's `torch.optim.AdamW` (decoupled weight decay, bias correction),
//! the learning-rate schedules of transformers' `get_*_schedule_with_warmup`, and
//! `clip_grad_norm_`'s global-norm clipping.
use crate::error::{Result, TrainError};
use crate::lora::LoraParams;

/// How the learning rate moves over the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Half a cosine from the peak to 0 after the warm-up.
    Cosine,
    /// A straight line from the peak to 0 after the warm-up.
    Linear,
    /// The peak throughout (after the warm-up).
    Constant,
}

impl Schedule {
    /// Parses `cosine`, `linear`, `constant`.
    pub fn parse(s: &str) -> Result<Schedule> {
        match s {
            "cosine" => Ok(Schedule::Cosine),
            "linear" => Ok(Schedule::Linear),
            "constant" => Ok(Schedule::Constant),
            _ => Err(TrainError::Config(format!(
                "unknown schedule '{s}' (cosine, linear, constant)"
            ))),
        }
    }

    /// The multiplier of the peak rate at optimizer step `step` (0-based) of `total`.
    pub fn factor(self, step: usize, warmup: usize, total: usize) -> f64 {
        if step < warmup {
            return step as f64 / warmup.max(1) as f64;
        }
        let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
        match self {
            Schedule::Cosine => (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0),
            Schedule::Linear => ((total as f64 - step as f64)
                / (total.saturating_sub(warmup)).max(1) as f64)
                .max(0.0),
            Schedule::Constant => 1.0,
        }
    }
}

/// AdamW's hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// β₁.
    pub beta1: f32,
    /// β₂.
    pub beta2: f32,
    /// ε.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// LoRA+: the learning rate of every `B` is this times the base rate.
    pub lora_plus_ratio: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            lora_plus_ratio: 1.0,
        }
    }
}

/// AdamW state: first and second moments and the step count.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    /// Hyperparameters.
    pub config: AdamWConfig,
    /// First moments.
    pub m: LoraParams,
    /// Second moments.
    pub v: LoraParams,
    /// Steps taken.
    pub step: u64,
}

impl AdamW {
    /// Fresh state for `params`.
    pub fn new(config: AdamWConfig, params: &LoraParams) -> AdamW {
        AdamW {
            config,
            m: params.zeros_like(),
            v: params.zeros_like(),
            step: 0,
        }
    }

    /// One update of `params` with gradient `grads` at learning rate `lr`.
    pub fn update(&mut self, params: &mut LoraParams, grads: &LoraParams, lr: f32) {
        self.step += 1;
        let c = self.config;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
        let moments = self.m.pairs_mut().zip(self.v.pairs_mut());
        let grads = grads.iter().map(|(_, _, g)| g);
        for ((p, g), (m, v)) in params.pairs_mut().zip(grads).zip(moments) {
            let groups = [
                (&mut p.a, &g.a, &mut m.a, &mut v.a, lr),
                (&mut p.b, &g.b, &mut m.b, &mut v.b, lr * c.lora_plus_ratio),
            ];
            for (p, g, m, v, lr) in groups {
                let step_size = lr / bc1;
                for i in 0..p.len() {
                    p[i] *= 1.0 - lr * c.weight_decay;
                    m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
                    v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * g[i] * g[i];
                    let denom = v[i].sqrt() / bc2_sqrt + c.eps;
                    p[i] -= step_size * m[i] / denom;
                }
            }
        }
    }
}

/// Scales `grads` so their global L2 norm is at most `max_norm` (`clip_grad_norm_`:
/// factor `max_norm / (norm + 1e-6)` when below 1); returns the norm before clipping.
/// `max_norm <= 0` only measures.
pub fn clip_global_norm(grads: &mut LoraParams, max_norm: f32) -> f32 {
    let norm = grads.norm();
    if max_norm > 0.0 {
        let k = max_norm / (norm + 1e-6);
        if k < 1.0 {
            grads.scale(k);
        }
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_matches_transformers() {
        // get_cosine_schedule_with_warmup(warmup=2, total=10).
        let s = Schedule::Cosine;
        assert_eq!(s.factor(0, 2, 10), 0.0);
        assert_eq!(s.factor(1, 2, 10), 0.5);
        assert_eq!(s.factor(2, 2, 10), 1.0);
        assert!((s.factor(6, 2, 10) - 0.5).abs() < 1e-12);
        assert!(Schedule::Linear.factor(6, 2, 10) - 0.5 < 1e-12);
    }
}
