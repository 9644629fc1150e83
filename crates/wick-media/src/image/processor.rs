//! The image processors of the supported vision towers, as transformers' PIL processors
//! compute them: the resize rule, the resampling filter, rescaling and normalisation, into
//! channels-first `f32` pixels.
use super::decode::RgbImage;
use super::resample::{resize, Filter};
use crate::error::MediaError;

/// How a vision tower wants its pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ImageProcessor {
    /// Gemma 3 (`Gemma3ImageProcessor`): bilinear resize to `size × size` without keeping
    /// the aspect ratio, then `(x / 255 − 0.5) / 0.5`.
    Gemma3 {
        /// Side of the square the tower reads.
        size: usize,
    },
    /// Gemma 4 (`Gemma4ImageProcessor`): bicubic resize keeping the aspect ratio to the
    /// largest multiples of `patch × pool` pixels holding at most `max_patches` patches,
    /// then `x / 255`.
    Gemma4 {
        /// Patch side in pixels.
        patch: usize,
        /// Pooling factor per side.
        pool: usize,
        /// Most patches per image.
        max_patches: usize,
    },
    /// Qwen-VL (`Qwen2VLImageProcessor`): bicubic "smart resize" keeping the aspect ratio
    /// to multiples of `patch × merge` pixels within `min_pixels ..= max_pixels`
    /// ([`qwen_target_size`]), then `(x / 255 − mean) / std`; one soft token per
    /// `merge × merge` patches. (The tower cuts the image into patches itself.)
    Qwen {
        /// Patch side in pixels.
        patch: usize,
        /// Patches per side of a soft token's window.
        merge: usize,
        /// Fewest pixels after resizing.
        min_pixels: usize,
        /// Most pixels after resizing.
        max_pixels: usize,
        /// Per-channel mean.
        mean: [f32; 3],
        /// Per-channel standard deviation.
        std: [f32; 3],
    },
}

/// Pixels ready for a vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedImage {
    /// Channels (3).
    pub channels: usize,
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
    /// `channels × height × width` values, one plane per channel.
    pub data: Vec<f32>,
    /// Soft tokens the image takes in the prompt, where the processor decides it (Gemma 4);
    /// `None` for towers with a fixed count per image.
    pub soft_tokens: Option<usize>,
}

/// What an image becomes, known from its size alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Height after resizing.
    pub height: usize,
    /// Width after resizing.
    pub width: usize,
    /// Soft tokens, where the processor decides them (`None`: a fixed count per image).
    pub soft_tokens: Option<usize>,
}

/// Most pixels a processor may resize an image to (12 bytes each as `f32` planes): Qwen2-VL's
/// default budget is 12.8 megapixels.
pub const MAX_OUTPUT_PIXELS: usize = 1 << 24;

impl ImageProcessor {
    /// Whether the settings (read from a model's config) make sane pixels: non-zero sizes,
    /// at most [`MAX_OUTPUT_PIXELS`] out, a finite mean and a standard deviation in
    /// `1e-3..=1e3` (a zero one made every pixel infinite).
    pub fn check(&self) -> Result<(), MediaError> {
        let bad = |what: String| Err(MediaError::Config(what));
        match *self {
            ImageProcessor::Gemma3 { size } => {
                if size == 0 || size.saturating_mul(size) > MAX_OUTPUT_PIXELS {
                    return bad(format!("Gemma 3 image size {size}"));
                }
            }
            ImageProcessor::Gemma4 {
                patch,
                pool,
                max_patches,
            } => {
                if patch == 0
                    || pool == 0
                    || max_patches == 0
                    || max_patches.saturating_mul(patch.saturating_mul(patch)) > MAX_OUTPUT_PIXELS
                {
                    return bad(format!(
                        "Gemma 4 patch {patch}, pooling {pool}, {max_patches} patches"
                    ));
                }
            }
            ImageProcessor::Qwen {
                patch,
                merge,
                min_pixels,
                max_pixels,
                mean,
                std,
            } => {
                if patch == 0
                    || merge == 0
                    || min_pixels > max_pixels
                    || max_pixels > MAX_OUTPUT_PIXELS
                {
                    return bad(format!(
                        "Qwen patch {patch}, merge {merge}, pixels {min_pixels}..={max_pixels}"
                    ));
                }
                let sane_std = |s: f32| s.is_finite() && (1e-3..=1e3).contains(&s);
                if !mean.iter().all(|m| m.is_finite() && m.abs() <= 1e3)
                    || !std.iter().copied().all(sane_std)
                {
                    return bad(format!(
                        "normalisation mean {mean:?}, std {std:?} (a finite mean, std in 1e-3..=1e3)"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The size an image of `width × height` pixels is resized to and the soft tokens it
    /// takes: what it will cost, from its header, before its pixels are decoded.
    pub fn layout(&self, width: usize, height: usize) -> Result<Layout, MediaError> {
        self.check()?;
        if width == 0 || height == 0 {
            return Err(MediaError::Processor(format!(
                "a {width}×{height} image has no pixels"
            )));
        }
        Ok(match *self {
            ImageProcessor::Gemma3 { size } => Layout {
                height: size,
                width: size,
                soft_tokens: None,
            },
            ImageProcessor::Gemma4 {
                patch,
                pool,
                max_patches,
            } => {
                let (h, w) = gemma4_target_size(height, width, patch, pool, max_patches)?;
                Layout {
                    height: h,
                    width: w,
                    soft_tokens: Some((h / patch) * (w / patch) / (pool * pool)),
                }
            }
            ImageProcessor::Qwen {
                patch,
                merge,
                min_pixels,
                max_pixels,
                ..
            } => {
                let factor = patch * merge;
                let (h, w) = qwen_target_size(height, width, factor, min_pixels, max_pixels)?;
                Layout {
                    height: h,
                    width: w,
                    soft_tokens: Some((h / factor) * (w / factor)),
                }
            }
        })
    }

    /// Prepares `image` for the tower.
    pub fn process(&self, image: &RgbImage) -> Result<ProcessedImage, MediaError> {
        let Layout {
            height,
            width,
            soft_tokens,
        } = self.layout(image.width, image.height)?;
        let resized = if (height, width) == (image.height, image.width) {
            std::borrow::Cow::Borrowed(image)
        } else {
            let filter = match self {
                ImageProcessor::Gemma3 { .. } => Filter::Bilinear,
                _ => Filter::Bicubic,
            };
            std::borrow::Cow::Owned(resize(image, width, height, filter))
        };
        let data = match *self {
            // transformers rescales in f64 and stores f32, then normalises in f32.
            ImageProcessor::Gemma3 { .. } => planes(&resized, |_, v| {
                let x = (f64::from(v) * (1.0 / 255.0)) as f32;
                (x - 0.5) / 0.5
            }),
            ImageProcessor::Gemma4 { .. } => {
                planes(&resized, |_, v| (f64::from(v) * (1.0 / 255.0)) as f32)
            }
            // Rescaled in f64 and stored as f32, then normalised in f32 per channel.
            ImageProcessor::Qwen { mean, std, .. } => planes(&resized, |c, v| {
                let x = (f64::from(v) * (1.0 / 255.0)) as f32;
                (x - mean[c]) / std[c]
            }),
        };
        Ok(ProcessedImage {
            channels: 3,
            height,
            width,
            data,
            soft_tokens,
        })
    }
}

/// Qwen-VL's target size `(height, width)`: each side rounded (half to even) to a multiple
/// of `factor`; when that holds more than `max_pixels`, both sides scaled down to fit (and
/// floored to multiples, at least one `factor`); when fewer than `min_pixels`, scaled up
/// (and ceiled). Aspect ratios beyond 200:1 are refused, as transformers does.
pub fn qwen_target_size(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), MediaError> {
    if height == 0 || width == 0 || factor == 0 {
        return Err(MediaError::Processor(format!(
            "cannot size a {width}×{height} image to multiples of {factor} px"
        )));
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    if h.max(w) / h.min(w) > 200.0 {
        return Err(MediaError::Processor(format!(
            "a {width}×{height} image is more than 200 times longer than it is wide"
        )));
    }
    let mut th = (h / f).round_ties_even() * f;
    let mut tw = (w / f).round_ties_even() * f;
    if th * tw > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        th = f.max((h / beta / f).floor() * f);
        tw = f.max((w / beta / f).floor() * f);
    } else if th * tw < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        th = (h * beta / f).ceil() * f;
        tw = (w * beta / f).ceil() * f;
    }
    let (th, tw) = (th as usize, tw as usize);
    if th == 0 || tw == 0 || th.saturating_mul(tw) > max_pixels.max(factor * factor) {
        return Err(MediaError::Processor(format!(
            "a {width}×{height} image resized to {tw}×{th} is outside the pixel budget {min_pixels}..={max_pixels}"
        )));
    }
    Ok((th, tw))
}

/// Channels-first values of an interleaved RGB image through `f(channel, value)`.
fn planes(image: &RgbImage, f: impl Fn(usize, u8) -> f32) -> Vec<f32> {
    let n = image.width * image.height;
    let mut data = vec![0f32; 3 * n];
    for (i, px) in image.data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            data[c * n + i] = f(c, px[c]);
        }
    }
    data
}

/// Gemma 4's target size `(height, width)`: the largest multiples of `patch × pool` with the
/// image's aspect ratio and at most `max_patches` patches; a very thin image keeps one
/// block on its short side and `floor(long / short)` blocks (capped) on the long one.
pub fn gemma4_target_size(
    height: usize,
    width: usize,
    patch: usize,
    pool: usize,
    max_patches: usize,
) -> Result<(usize, usize), MediaError> {
    if height == 0 || width == 0 || patch == 0 || pool == 0 {
        return Err(MediaError::Processor(format!(
            "cannot size a {width}×{height} image with patch {patch} and pool {pool}"
        )));
    }
    let target_px = (max_patches * patch * patch) as f64;
    let factor = (target_px / (height * width) as f64).sqrt();
    let side = pool * patch;
    let mut th = ((factor * height as f64) / side as f64).floor() as usize * side;
    let mut tw = ((factor * width as f64) / side as f64).floor() as usize * side;
    let max_side = (max_patches / (pool * pool)) * side;
    match (th, tw) {
        (0, 0) => {
            return Err(MediaError::Processor(format!(
                "a {width}×{height} image cannot be resized to a multiple of {side} px"
            )))
        }
        (0, _) => {
            th = side;
            tw = ((width as f64 / height as f64).floor() as usize * side).min(max_side);
        }
        (_, 0) => {
            tw = side;
            th = ((height as f64 / width as f64).floor() as usize * side).min(max_side);
        }
        _ => {}
    }
    if (th * tw) as f64 > target_px {
        return Err(MediaError::Processor(format!(
            "a {width}×{height} image resized to {tw}×{th} exceeds {max_patches} patches"
        )));
    }
    Ok((th, tw))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen_sizes_round_half_to_even_and_respect_the_budget() {
        // 40 / 16 = 2.5 rounds to 2 (Python's round).
        assert_eq!(qwen_target_size(40, 48, 16, 1024, 4096).unwrap(), (32, 48));
        // Over the budget: scaled down and floored.
        assert_eq!(qwen_target_size(64, 80, 16, 1024, 4096).unwrap(), (48, 64));
        // Under it: scaled up and ceiled.
        assert_eq!(qwen_target_size(10, 10, 16, 1024, 4096).unwrap(), (32, 32));
        assert!(qwen_target_size(1, 400, 16, 1024, 4096).is_err());
    }

    #[test]
    fn gemma4_sizes_are_multiples_within_budget() {
        // 280 soft tokens × 9 patches of 16 px.
        let (h, w) = gemma4_target_size(480, 640, 16, 3, 2520).unwrap();
        assert_eq!((h % 48, w % 48), (0, 0));
        assert!(h * w <= 2520 * 256);
        assert_eq!((h, w), (672, 912));
        // A thin strip keeps one block on its short side.
        assert_eq!(
            gemma4_target_size(10, 4000, 16, 3, 2520).unwrap(),
            (48, 13440)
        );
    }
}
