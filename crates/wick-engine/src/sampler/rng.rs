//! Per-step random numbers keyed by `(seed, step, stream)`, and fresh request seeds.
//!
//! Every random draw of a sampling step comes from a generator derived from the request's
//! seed and the step number alone, so a request gets the same tokens for the same seed no
//! matter how it was batched or what else ran. Separate draws of one step (the XTC coin, the
//! categorical draw) use separate [`RngStream`]s, so switching XTC on does not move the
//! categorical draws. The generator is SplitMix64 (Steele, Lea & Flood, 2014), small and
//! fixed here, so results do not change with a dependency update.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Increment of the Weyl sequence behind [`fresh_seed`] (2^32 / golden ratio, odd).
const WEYL_INCREMENT: u64 = 0x9e37_79b9;

/// Increment of the SplitMix64 state (2^64 / golden ratio).
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The independent draws within one sampling step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RngStream {
    /// The draw of the next token from the final distribution.
    Categorical,
    /// XTC's coin: whether it removes the top choices this step.
    Xtc,
    /// The redraw after a speculative draft was rejected ([`crate::speculative`]).
    Resample,
    /// A draft model's draw of its guess for this step ([`crate::speculative`]).
    Draft,
}

/// SplitMix64's output function: a bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A random generator for one draw of one step.
#[derive(Debug, Clone)]
pub struct StepRng {
    state: u64,
}

impl StepRng {
    /// The generator of `stream` at `step` of the request seeded with `seed`.
    pub fn new(seed: u64, step: u64, stream: RngStream) -> Self {
        let stream_key = match stream {
            RngStream::Categorical => 0x243f_6a88_85a3_08d3,
            RngStream::Xtc => 0x1319_8a2e_0370_7344,
            RngStream::Resample => 0xa409_3822_299f_31d0,
            RngStream::Draft => 0x082e_fa98_ec4e_6c89,
        };
        let key = mix64(step.wrapping_mul(GOLDEN_GAMMA) ^ stream_key);
        Self {
            state: mix64(seed ^ key),
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// A uniform number in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A seed for a request that gave none: never the same twice within a process.
///
/// mlx-bun's rule, made collision-free: a Weyl sequence (`n * 0x9e3779b9`, a bijection on
/// `u64` because the increment is odd) xor-ed with one clock reading taken at the first
/// call, so runs differ and calls within a run never repeat.
pub fn fresh_seed() -> u64 {
    static BASE: OnceLock<u64> = OnceLock::new();
    static WEYL: AtomicU64 = AtomicU64::new(0);
    let base = *BASE.get_or_init(|| {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        now ^ (u64::from(std::process::id()) << 40)
    });
    let weyl = WEYL
        .fetch_add(WEYL_INCREMENT, Ordering::Relaxed)
        .wrapping_add(WEYL_INCREMENT);
    base ^ weyl
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn same_key_same_numbers_and_streams_differ() {
        let draws = |seed, step, stream| {
            let mut rng = StepRng::new(seed, step, stream);
            (0..4).map(|_| rng.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(
            draws(7, 3, RngStream::Categorical),
            draws(7, 3, RngStream::Categorical)
        );
        assert_ne!(
            draws(7, 3, RngStream::Categorical),
            draws(7, 3, RngStream::Xtc)
        );
        assert_ne!(
            draws(7, 3, RngStream::Categorical),
            draws(7, 4, RngStream::Categorical)
        );
        assert_ne!(
            draws(7, 3, RngStream::Categorical),
            draws(8, 3, RngStream::Categorical)
        );
    }

    #[test]
    fn uniform_is_in_range_and_roughly_uniform() {
        let mut sum = 0.0;
        let n = 100_000;
        for step in 0..n {
            let u = StepRng::new(42, step, RngStream::Categorical).next_f64();
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        let mean = sum / n as f64;
        // Standard error of the mean is 1/sqrt(12 n) ~ 0.0009.
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    }

    #[test]
    fn fresh_seeds_do_not_repeat() {
        let seeds: HashSet<u64> = (0..10_000).map(|_| fresh_seed()).collect();
        assert_eq!(seeds.len(), 10_000);
    }
}
