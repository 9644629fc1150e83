//! How many prompt tokens a step carries.
//!
//! A step's time is measured from its beginning to the next step's beginning, what its
//! decoding rows wait for their next token: on a GPU the pass's own call returns once its
//! work is queued, and the host plans the next step while the device computes.
//!
//! A prompt alone (no sequence decoding) goes through in steps of
//! [`EngineConfig::prompt_step_tokens`]: on a GPU, long chunks keep the tensor cores busy
//! and read the weights once per few thousand tokens instead of once per 512. When
//! sequences are decoding, every step that carries a prompt chunk delays their next token
//! by the step's length, so with [`EngineConfig::itl_factor`] set the chunk is steered by
//! measured step times: the target is the factor times a decode-only step (a moving
//! average), and after each step with a chunk beside decoding rows the next chunk is the
//! last one scaled by target / measured time (growing at most [`MAX_GROWTH`]× a step),
//! within [`MIN_PACED_TOKENS`] and the step budget.
//!
//! Scaling by the ratio converges on the chunk whose step meets the target whatever the
//! step's fixed cost: with a step taking `a + b·c` for a chunk of `c`, the fixed point is
//! `(target − a) / b` and each step moves the chunk by a factor `a / target < 1` of its
//! distance to it. (Estimating a per-token cost from `(time − decode step) / c` instead
//! charges the mixed step's own fixed cost — its kernels launched one by one where a
//! decode step replays a graph — to the chunk's tokens, and the chunk shrinks to nothing.)
use super::EngineConfig;

/// The fewest prompt tokens a paced step carries: below this a chunk's fixed costs would
/// make the prompt crawl.
pub(crate) const MIN_PACED_TOKENS: usize = 32;

/// The first paced chunk, before any paced step was measured (at most the step budget).
const FIRST_PACED_TOKENS: usize = 128;

/// A paced chunk grows at most by this factor from one step to the next.
const MAX_GROWTH: f64 = 1.5;

/// Weight of the newest decode-only step in the moving average.
const SMOOTHING: f64 = 0.3;

/// The measured step times that size prompt chunks beside decoding rows.
#[derive(Debug, Default)]
pub(crate) struct PromptPacer {
    /// Seconds of a step of decode rows only (moving average).
    decode_step: Option<f64>,
    /// The next chunk beside decoding rows.
    chunk: Option<usize>,
}

impl PromptPacer {
    /// Tokens the next step may carry, its `decoding` decode rows included: the lone-prompt
    /// budget when none decode, else the paced chunk plus the decode rows when pacing is
    /// on (`itl_factor`), never more than the step budget.
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
        if itl_factor.is_none() {
            return budget;
        }
        let chunk = self.chunk.unwrap_or(FIRST_PACED_TOKENS);
        (chunk.max(MIN_PACED_TOKENS) + decoding).min(budget)
    }

    /// Records a step of `decode_rows` decode rows and `prompt_tokens` prompt tokens that
    /// took `seconds`, steering the next chunk toward `itl_factor` × a decode-only step.
    /// (The step measured is the one before the step being planned, so the chunk reacts
    /// one step late; the controller converges all the same.)
    pub(crate) fn observe(
        &mut self,
        itl_factor: Option<f64>,
        decode_rows: usize,
        prompt_tokens: usize,
        seconds: f64,
    ) {
        if !seconds.is_finite() || seconds <= 0.0 || decode_rows == 0 {
            return;
        }
        if prompt_tokens == 0 {
            self.decode_step = Some(match self.decode_step {
                Some(d) => d + SMOOTHING * (seconds - d),
                None => seconds,
            });
            return;
        }
        let (Some(factor), Some(step)) = (itl_factor, self.decode_step) else {
            return;
        };
        let ratio = (factor * step / seconds).min(MAX_GROWTH);
        let next = (prompt_tokens as f64 * ratio).floor();
        self.chunk = Some(if next.is_finite() {
            (next as usize).max(MIN_PACED_TOKENS)
        } else {
            MIN_PACED_TOKENS
        });
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
    fn without_pacing_chunks_beside_decoding_rows_take_the_step_budget() {
        let mut p = PromptPacer::default();
        p.observe(None, 3, 0, 0.010);
        p.observe(None, 3, 500, 0.060);
        assert_eq!(p.step_tokens(&config(512), 8192, None, 3), 512);
    }

    /// A simulated GPU: a decode-only step of 10 ms (a replayed graph), a mixed step of
    /// 13 ms fixed (kernels launched one by one) plus 0.05 ms a prompt token. Factor 2:
    /// 20 ms, met by a chunk of (20 − 13) / 0.05 = 140 tokens.
    #[test]
    fn chunks_converge_on_the_step_time_the_factor_allows() {
        let mut p = PromptPacer::default();
        let f = Some(2.0);
        let mixed = |c: usize| 0.013 + 0.000_05 * c as f64;
        for _ in 0..5 {
            p.observe(f, 4, 0, 0.010);
        }
        let mut chunk = 0;
        for _ in 0..30 {
            let tokens = p.step_tokens(&config(4096), 8192, f, 4);
            chunk = tokens - 4;
            p.observe(f, 4, chunk, mixed(chunk));
        }
        assert!((135..=141).contains(&chunk), "{chunk}");
        assert!(mixed(chunk) <= 0.0201, "{}", mixed(chunk));
        // The context grows: each token costs twice as much, the chunk halves or so.
        let slower = |c: usize| 0.013 + 0.000_1 * c as f64;
        for _ in 0..30 {
            chunk = p.step_tokens(&config(4096), 8192, f, 4) - 4;
            p.observe(f, 4, chunk, slower(chunk));
        }
        assert!((65..=71).contains(&chunk), "{chunk}");
        // A step whose fixed cost alone passes the target: the floor.
        for _ in 0..30 {
            chunk = p.step_tokens(&config(4096), 8192, f, 4) - 4;
            p.observe(f, 4, chunk, 0.025 + 0.000_05 * chunk as f64);
        }
        assert_eq!(chunk, MIN_PACED_TOKENS);
        // Never past the step budget; nonsense timings are ignored.
        p.observe(f, 4, 32, f64::NAN);
        p.observe(f, 4, 32, -1.0);
        assert_eq!(p.step_tokens(&config(20), 8192, f, 4), 20);
    }
}
