//! Gemma 4's log-mel features (`Gemma4AudioFeatureExtractor`): the clip padded to a
//! multiple of 128 samples, 160 zeros in front, 320-sample frames every 160 samples under a
//! periodic Hann window (f32), a 512-point FFT's magnitudes, 128 HTK mel bins over 0–8 kHz,
//! `ln(mel + 0.001)`; frames that end in the padding are zeroed and carry no soft token.
use realfft::RealFftPlanner;

use crate::error::MediaError;

/// The feature extractor's settings (Gemma 4's defaults in [`Default`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MelConfig {
    /// Sample rate the features assume.
    pub sample_rate: u32,
    /// Samples per frame.
    pub frame: usize,
    /// Samples between frames.
    pub hop: usize,
    /// FFT size.
    pub fft: usize,
    /// Mel bins.
    pub bins: usize,
    /// Lowest filter frequency, Hz.
    pub min_hz: f64,
    /// Highest filter frequency, Hz.
    pub max_hz: f64,
    /// Added before the logarithm.
    pub floor: f64,
    /// The clip is zero-padded to a multiple of this many samples.
    pub pad_multiple: usize,
    /// Samples kept (the rest is dropped).
    pub max_samples: usize,
}

impl Default for MelConfig {
    fn default() -> Self {
        MelConfig {
            sample_rate: 16_000,
            frame: 320,
            hop: 160,
            fft: 512,
            bins: 128,
            min_hz: 0.0,
            max_hz: 8000.0,
            floor: 1e-3,
            pad_multiple: 128,
            max_samples: 480_000,
        }
    }
}

/// A clip's features.
#[derive(Debug, Clone, PartialEq)]
pub struct MelFeatures {
    /// Frames.
    pub frames: usize,
    /// Bins per frame.
    pub bins: usize,
    /// `frames × bins` values, frame-major.
    pub data: Vec<f32>,
    /// Whether each frame holds only real samples (the others are zero).
    pub mask: Vec<bool>,
}

impl MelFeatures {
    /// Soft tokens of the clip: the frame mask subsampled by 2 twice (the tower's two
    /// stride-2 convolutions), counted.
    pub fn soft_tokens(&self) -> usize {
        let mut mask = self.mask.clone();
        for _ in 0..2 {
            mask = mask.into_iter().step_by(2).collect();
        }
        mask.into_iter().filter(|&m| m).count()
    }
}

impl MelConfig {
    /// Whether the settings make features: every size non-zero, the FFT at least a frame,
    /// a filter band, at most 1024 bins, a rate of 1–384 kHz.
    pub fn check(&self) -> Result<(), MediaError> {
        let bad = |what: String| Err(MediaError::Config(format!("audio features: {what}")));
        if !(1_000..=384_000).contains(&self.sample_rate) {
            return bad(format!("sample rate {} Hz", self.sample_rate));
        }
        if self.frame == 0 || self.hop == 0 || self.pad_multiple == 0 || self.max_samples == 0 {
            return bad(format!(
                "frame {}, hop {}, padding multiple {} and samples kept {} must be non-zero",
                self.frame, self.hop, self.pad_multiple, self.max_samples
            ));
        }
        if self.fft < self.frame.max(2) || self.fft > 1 << 16 {
            return bad(format!(
                "FFT size {} for frames of {}",
                self.fft, self.frame
            ));
        }
        if !(1..=1024).contains(&self.bins) {
            return bad(format!("{} mel bins", self.bins));
        }
        if !(self.min_hz >= 0.0 && self.min_hz < self.max_hz && self.max_hz.is_finite()) {
            return bad(format!("filter band {}..{} Hz", self.min_hz, self.max_hz));
        }
        if !(self.floor.is_finite() && self.floor > 0.0) {
            return bad(format!("floor {}", self.floor));
        }
        Ok(())
    }

    /// The features of `samples` (mono, at `sample_rate`).
    pub fn features(&self, samples: &[f32]) -> MelFeatures {
        let real = samples.len().min(self.max_samples);
        let padded = real.div_ceil(self.pad_multiple) * self.pad_multiple;
        let left = self.frame / 2;
        let mut wave = vec![0f32; left + padded];
        wave[left..left + real].copy_from_slice(&samples[..real]);
        let span = self.frame + 1;
        let frames = if wave.len() >= span {
            (wave.len() - span) / self.hop + 1
        } else {
            0
        };
        let window = self.window();
        let filters = self.filter_bank();
        let spectrum_len = self.fft / 2 + 1;
        let mut planner = RealFftPlanner::<f64>::new();
        let fft = planner.plan_fft_forward(self.fft);
        let mut input = fft.make_input_vec();
        let mut output = fft.make_output_vec();
        let mut scratch = fft.make_scratch_vec();
        let mut magnitude = vec![0f64; spectrum_len];
        let mut data = vec![0f32; frames * self.bins];
        let mut mask = Vec::with_capacity(frames);
        for f in 0..frames {
            let start = f * self.hop;
            // The frame's last sample index in the padded clip (with the unused 321st).
            let end = start + span - 1;
            let real_frame = end >= left && end - left < real;
            mask.push(real_frame);
            if !real_frame {
                continue;
            }
            input.fill(0.0);
            for (i, (x, w)) in wave[start..start + self.frame]
                .iter()
                .zip(&window)
                .enumerate()
            {
                // transformers multiplies in f32.
                input[i] = f64::from(x * w);
            }
            if fft
                .process_with_scratch(&mut input, &mut output, &mut scratch)
                .is_err()
            {
                continue;
            }
            for (m, c) in magnitude.iter_mut().zip(&output) {
                // Magnitudes are f32 in transformers (numpy's complex64 FFT).
                *m = f64::from(c.norm() as f32);
            }
            let row = &mut data[f * self.bins..(f + 1) * self.bins];
            for (b, out) in row.iter_mut().enumerate() {
                let mel: f64 = magnitude
                    .iter()
                    .enumerate()
                    .map(|(k, m)| m * filters[k * self.bins + b])
                    .sum();
                *out = (mel + self.floor).ln() as f32;
            }
        }
        MelFeatures {
            frames,
            bins: self.bins,
            data,
            mask,
        }
    }

    /// The periodic Hann window, computed in f64 and stored in f32.
    fn window(&self) -> Vec<f32> {
        let n = self.frame as f64;
        (0..self.frame)
            .map(|i| (0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n).cos()) as f32)
            .collect()
    }

    /// Triangular HTK-mel filters, `[fft/2 + 1, bins]`, unnormalised.
    fn filter_bank(&self) -> Vec<f64> {
        let to_mel = |hz: f64| 2595.0 * (1.0 + hz / 700.0).log10();
        let to_hz = |mel: f64| 700.0 * (10f64.powf(mel / 2595.0) - 1.0);
        let (lo, hi) = (to_mel(self.min_hz), to_mel(self.max_hz));
        let points = self.bins + 2;
        let edges: Vec<f64> = (0..points)
            .map(|i| to_hz(linspace(lo, hi, points, i)))
            .collect();
        let spectrum_len = self.fft / 2 + 1;
        let nyquist = f64::from(self.sample_rate / 2);
        let mut bank = vec![0f64; spectrum_len * self.bins];
        for k in 0..spectrum_len {
            let f = linspace(0.0, nyquist, spectrum_len, k);
            for b in 0..self.bins {
                let down = -(edges[b] - f) / (edges[b + 1] - edges[b]);
                let up = (edges[b + 2] - f) / (edges[b + 2] - edges[b + 1]);
                bank[k * self.bins + b] = down.min(up).max(0.0);
            }
        }
        bank
    }
}

/// numpy's `linspace(start, stop, n)[i]`.
fn linspace(start: f64, stop: f64, n: usize, i: usize) -> f64 {
    if n < 2 {
        return start;
    }
    if i == n - 1 {
        return stop;
    }
    let step = (stop - start) / (n - 1) as f64;
    start + i as f64 * step
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings come from a model's config: a zero hop divided by zero and an FFT shorter
    /// than a frame indexed past its buffer (panics in the request's worker).
    #[test]
    fn settings_that_cannot_make_features_are_refused() {
        let defaults = MelConfig::default();
        assert!(defaults.check().is_ok());
        for bad in [
            MelConfig { hop: 0, ..defaults },
            MelConfig {
                fft: 256,
                ..defaults
            },
            MelConfig {
                bins: 0,
                ..defaults
            },
            MelConfig {
                sample_rate: 0,
                ..defaults
            },
            MelConfig {
                max_hz: f64::NAN,
                ..defaults
            },
            MelConfig {
                floor: 0.0,
                ..defaults
            },
        ] {
            let err = crate::prepare_audio(&[], &crate::AudioLimits::default(), &bad).unwrap_err();
            assert!(matches!(err, MediaError::Config(_)), "{bad:?}: {err:?}");
        }
    }
}
