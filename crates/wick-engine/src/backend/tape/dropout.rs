//! LoRA dropout: the adapter branch of a projection reads `drop(x)` instead of `x`
//! (`y = W·x + s·B·A·drop(x)`, PEFT's placement), where `drop` zeroes each input value
//! with probability `p` and scales the rest by `1/(1−p)`.
//!
//! The mask is not stored: it is a pure function of a key (the run's seed, the optimizer
//! step, the micro-batch), the layer, the projection and the element's index, so the
//! backward, or a forward recomputed under gradient checkpointing, draws the same mask
//! again from the same numbers.
use rayon::prelude::*;

/// Dropout of one forward/backward pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    /// The probability of zeroing a value, in `[0, 1)`.
    pub p: f32,
    /// The pass's key (seed, step and micro-batch mixed).
    pub key: u64,
}

/// SplitMix64's finalizer: a bijective mix of the 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Dropout {
    /// A pass's dropout: `None` when `p` is 0.
    pub fn new(p: f32, seed: u64, step: u64, micro: u64) -> Option<Dropout> {
        (p > 0.0).then(|| Dropout {
            p,
            key: mix(mix(mix(seed ^ 0x6c6f_7261_6472_6f70) ^ step) ^ micro),
        })
    }

    /// The key of one projection's mask.
    fn site(self, layer: usize, slot: usize) -> u64 {
        mix(self.key ^ mix(((layer as u64) << 8) | slot as u64))
    }

    /// Whether element `i` of the site keyed `site` is kept.
    fn kept(site: u64, i: usize, threshold: u64) -> bool {
        // The top 32 bits as a uniform draw in [0, 2³²).
        (mix(site.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))) >> 32) >= threshold
    }

    fn threshold(self) -> u64 {
        (f64::from(self.p) * 4_294_967_296.0) as u64
    }

    /// `drop(x)` of projection `slot` in `layer` (`x` `[rows, width]`).
    pub(crate) fn apply(self, x: &[f32], width: usize, layer: usize, slot: usize) -> Vec<f32> {
        let mut out = x.to_vec();
        self.scale_in_place(&mut out, width, layer, slot);
        out
    }

    /// Multiplies `v` (`[rows, width]`) by the mask of projection `slot` in `layer`,
    /// kept values by `1/(1−p)`: the forward's `drop(x)`, and the backward's factor on
    /// the gradient flowing into `x` through the adapter branch.
    pub(crate) fn scale_in_place(self, v: &mut [f32], width: usize, layer: usize, slot: usize) {
        let site = self.site(layer, slot);
        let threshold = self.threshold();
        let keep = 1.0 / (1.0 - self.p);
        v.par_chunks_mut(width.max(1))
            .enumerate()
            .for_each(|(row, r)| {
                let base = row * width;
                for (j, x) in r.iter_mut().enumerate() {
                    *x = if Self::kept(site, base + j, threshold) {
                        *x * keep
                    } else {
                        0.0
                    };
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_the_asked_fraction_and_keeps_the_mean() {
        let d = Dropout::new(0.25, 7, 3, 0).unwrap();
        let x = vec![1.0f32; 64 * 1024];
        let y = d.apply(&x, 1024, 2, 4);
        let zeros = y.iter().filter(|&&v| v == 0.0).count() as f64 / y.len() as f64;
        assert!((zeros - 0.25).abs() < 0.01, "dropped {zeros}");
        let mean = y.iter().map(|&v| f64::from(v)).sum::<f64>() / y.len() as f64;
        assert!((mean - 1.0).abs() < 0.02, "mean {mean}");
        assert!(y.iter().all(|&v| v == 0.0 || (v - 4.0 / 3.0).abs() < 1e-6));
    }

    #[test]
    fn the_mask_is_a_function_of_its_key_layer_and_slot() {
        let d = Dropout::new(0.5, 1, 10, 2).unwrap();
        let x: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        assert_eq!(d.apply(&x, 64, 3, 1), d.apply(&x, 64, 3, 1));
        assert_ne!(d.apply(&x, 64, 3, 1), d.apply(&x, 64, 3, 2));
        assert_ne!(d.apply(&x, 64, 3, 1), d.apply(&x, 64, 4, 1));
        let next = Dropout::new(0.5, 1, 11, 2).unwrap();
        assert_ne!(d.apply(&x, 64, 3, 1), next.apply(&x, 64, 3, 1));
        assert!(Dropout::new(0.0, 1, 10, 2).is_none());
    }
}
