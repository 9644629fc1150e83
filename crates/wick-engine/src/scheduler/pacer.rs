//! How many prompt tokens a step carries.
//!
//! A prompt alone (no sequence decoding) goes through in steps of
//! [`EngineConfig::prompt_step_tokens`]: on a GPU, long chunks keep the tensor cores busy
//! and read the weights once per few thousand tokens instead of once per 512. When
//! sequences are decoding, every step that carries a prompt chunk delays their next token
//! by the chunk's cost, so the chunk is sized from measured costs: the decode-only step
//! time and the marginal time per prompt token, each a moving average over recent steps,
//! give the chunk whose step takes at most [`EngineConfig::itl_factor`] times a
//! decode-only step, within [`MIN_PACED_TOKENS`] and the step budget. Until both costs
//! are measured (and on backends that do not pace) the chunk is the step budget.
use super::EngineConfig;

/// The fewest prompt tokens a paced step carries: below this a chunk's fixed costs
/// (launches, a pass over the weights for few rows) would make the prompt crawl.
pub(crate) const MIN_PACED_TOKENS: usize = 32;

/// Weight of the newest observation in the moving averages.
const SMOOTHING: f64 = 0.3;

/// The measured costs that size prompt chunks beside decoding rows.
#[derive(Debug, Default)]
pub(crate) struct PromptPacer {
    /// Seconds of a step of decode rows only.
    decode_step: Option<f64>,
    /// Seconds a prompt token adds to a step.
    token_cost: Option<f64>,
}

fn average(old: Option<f64>, new: f64) -> Option<f64> {
    Some(match old {
        Some(o) => o + SMOOTHING * (new - o),
        None => new,
    })
}

impl PromptPacer {
    /// Prompt tokens (and decode rows) the next step may carry when `decoding` rows decode
    /// in it: the lone-prompt budget when none do, else the paced chunk plus the decode
    /// rows, never more than the step budget.
    pub(crate) fn step_tokens(
        &self,
        config: &EngineConfig,
        lone_tokens: usize,
        itl_factor: Option<f64>,
        decoding: usize,
    ) -> usize {
        let budget = config.step_token_budget;
        if decoding == 0 {
            return lone_tokens.max(1);
        }
        let (Some(factor), Some(step), Some(cost)) =
            (itl_factor, self.decode_step, self.token_cost)
        else {
            return budget;
        };
        if cost <= 0.0 {
            return budget;
        }
        let paced = ((factor - 1.0).max(0.0) * step / cost).floor();
        let paced = if paced.is_finite() {
            paced as usize
        } else {
            budget
        };
        (paced.max(MIN_PACED_TOKENS) + decoding).min(budget)
    }

    /// Records a step of `decode_rows` decode rows and `prompt_tokens` prompt tokens that
    /// took `seconds`.
    pub(crate) fn observe(&mut self, decode_rows: usize, prompt_tokens: usize, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        if prompt_tokens == 0 {
            if decode_rows > 0 {
                self.decode_step = average(self.decode_step, seconds);
            }
            return;
        }
        // A mixed step's prompt part is what it took beyond a decode-only step; a step of
        // prompt chunks only charges all of it to the prompt tokens.
        let base = if decode_rows > 0 {
            self.decode_step.unwrap_or(0.0)
        } else {
            0.0
        };
        let cost = (seconds - base).max(0.0) / prompt_tokens as f64;
        self.token_cost = average(self.token_cost, cost);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(budget: usize) -> EngineConfig {
        EngineConfig {
            step_token_budget: budget,
            ..EngineConfig::default()
        }
    }

    #[test]
    fn a_lone_prompt_gets_the_lone_budget() {
        let p = PromptPacer::default();
        assert_eq!(p.step_tokens(&config(512), 8192, Some(2.0), 0), 8192);
        assert_eq!(p.step_tokens(&config(512), 512, None, 0), 512);
    }

    #[test]
    fn chunks_beside_decoding_rows_cost_at_most_the_factor_times_a_decode_step() {
        let mut p = PromptPacer::default();
        // Unmeasured: the step budget.
        assert_eq!(p.step_tokens(&config(512), 8192, Some(2.0), 3), 512);
        // A decode step of 10 ms; a mixed step of 3 rows and 500 prompt tokens took 60 ms:
        // 0.1 ms a prompt token, so 10 ms more (factor 2) is 100 tokens.
        p.observe(3, 0, 0.010);
        p.observe(3, 500, 0.060);
        assert_eq!(p.step_tokens(&config(512), 8192, Some(2.0), 3), 103);
        // Factor 3: 200 tokens; never past the step budget, never under the floor.
        assert_eq!(p.step_tokens(&config(512), 8192, Some(3.0), 3), 203);
        assert_eq!(p.step_tokens(&config(150), 8192, Some(3.0), 3), 150);
        assert_eq!(
            p.step_tokens(&config(512), 8192, Some(1.0), 3),
            MIN_PACED_TOKENS + 3
        );
        // Pacing off: the step budget.
        assert_eq!(p.step_tokens(&config(512), 8192, None, 3), 512);
    }

    #[test]
    fn costs_follow_the_recent_steps() {
        let mut p = PromptPacer::default();
        p.observe(1, 0, 0.010);
        p.observe(0, 1000, 0.100);
        let first = p.step_tokens(&config(4096), 8192, Some(2.0), 1);
        assert_eq!(first, 101);
        // Longer context: prompt tokens cost more, chunks shrink.
        for _ in 0..20 {
            p.observe(1, 100, 0.010 + 100.0 * 0.0004);
        }
        let later = p.step_tokens(&config(4096), 8192, Some(2.0), 1);
        assert!(later < first && later >= 25, "{later}");
        // Nonsense timings are ignored.
        p.observe(1, 10, f64::NAN);
        p.observe(1, 10, -1.0);
        assert_eq!(p.step_tokens(&config(4096), 8192, Some(2.0), 1), later);
    }
}
