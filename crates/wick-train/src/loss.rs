//! The losses as TRL computes them, as functions of per-token log-probabilities, with
//! their gradients (`∂L/∂log p` per token) for the backward.
//!
//! - SFT: mean cross-entropy over the completion tokens of the whole optimizer step
//!   (the token count of every accumulated micro-batch is the divisor, as transformers'
//!   `num_items_in_batch`).
//! - DPO (sigmoid): `h = (π_c − ref_c) − (π_r − ref_r)` of summed completion log-probs,
//!   `L = mean(−log σ(β·h))`.
//! - ORPO: `L = NLL(chosen) − λ·mean(log σ(log_odds))`, `log_odds = f(p̄_c) − f(p̄_r)`,
//!   `f(p) = p − log(1 − eᵖ)`, `p̄` the mean completion log-prob; the NLL is TRL's: mean
//!   cross-entropy over every non-pad token of the chosen sequences (prompt included).

/// Which objective trains the adapter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Method {
    /// Supervised fine-tuning.
    Sft,
    /// Direct preference optimization, sigmoid loss.
    Dpo {
        /// β.
        beta: f32,
    },
    /// Odds-ratio preference optimization.
    Orpo {
        /// λ (TRL's `beta`).
        lambda: f32,
    },
}

impl Method {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Method::Sft => "sft",
            Method::Dpo { .. } => "dpo",
            Method::Orpo { .. } => "orpo",
        }
    }

    /// Whether rows are preference pairs.
    pub fn is_preference(self) -> bool {
        !matches!(self, Method::Sft)
    }
}

fn log_sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        -(-x).exp().ln_1p()
    } else {
        x - x.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// One pair's DPO loss term (before the mean) and gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpoTerm {
    /// `−log σ(β·h)`.
    pub loss: f64,
    /// `∂loss/∂π_c` (and `−` that for `π_r`).
    pub d_chosen: f64,
    /// `β·(π_c − ref_c)`.
    pub reward_chosen: f64,
    /// `β·(π_r − ref_r)`.
    pub reward_rejected: f64,
}

/// DPO for one pair of summed completion log-probs.
pub fn dpo(beta: f64, pi_c: f64, pi_r: f64, ref_c: f64, ref_r: f64) -> DpoTerm {
    let h = (pi_c - ref_c) - (pi_r - ref_r);
    DpoTerm {
        loss: -log_sigmoid(beta * h),
        d_chosen: -beta * sigmoid(-beta * h),
        reward_chosen: beta * (pi_c - ref_c),
        reward_rejected: beta * (pi_r - ref_r),
    }
}

/// One pair's ORPO odds-ratio term (before the mean, λ applied) and gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OrpoTerm {
    /// `−λ·log σ(log_odds)`.
    pub loss: f64,
    /// `∂loss/∂p̄_c`.
    pub d_mean_chosen: f64,
    /// `∂loss/∂p̄_r`.
    pub d_mean_rejected: f64,
    /// The log odds ratio.
    pub log_odds: f64,
}

/// `log(1 − eˣ)` for `x < 0`, accurate on both sides of `−ln 2`.
fn log1mexp(x: f64) -> f64 {
    if x < -std::f64::consts::LN_2 {
        (-x.exp()).ln_1p()
    } else {
        (-x.exp_m1()).ln()
    }
}

/// ORPO for one pair of mean completion log-probs.
pub fn orpo(lambda: f64, mean_c: f64, mean_r: f64) -> OrpoTerm {
    let log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r));
    // d/dp (p − log(1 − eᵖ)) = 1/(1 − eᵖ).
    let df = |p: f64| -1.0 / p.exp_m1();
    let d_lo = -lambda * sigmoid(-log_odds);
    OrpoTerm {
        loss: -lambda * log_sigmoid(log_odds),
        d_mean_chosen: d_lo * df(mean_c),
        d_mean_rejected: -d_lo * df(mean_r),
        log_odds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numeric(f: impl Fn(f64) -> f64, x: f64) -> f64 {
        (f(x + 1e-6) - f(x - 1e-6)) / 2e-6
    }

    #[test]
    fn dpo_gradient_matches_finite_differences() {
        let t = dpo(0.1, -12.0, -15.0, -13.0, -14.0);
        let n = numeric(|c| dpo(0.1, c, -15.0, -13.0, -14.0).loss, -12.0);
        assert!((n - t.d_chosen).abs() < 1e-6, "{n} vs {}", t.d_chosen);
        let n = numeric(|r| dpo(0.1, -12.0, r, -13.0, -14.0).loss, -15.0);
        assert!((n + t.d_chosen).abs() < 1e-6);
    }

    #[test]
    fn orpo_gradient_matches_finite_differences() {
        let t = orpo(0.1, -0.3, -1.7);
        let n = numeric(|c| orpo(0.1, c, -1.7).loss, -0.3);
        assert!(
            (n - t.d_mean_chosen).abs() < 1e-6,
            "{n} vs {}",
            t.d_mean_chosen
        );
        let n = numeric(|r| orpo(0.1, -0.3, r).loss, -1.7);
        assert!((n - t.d_mean_rejected).abs() < 1e-6);
    }
}
