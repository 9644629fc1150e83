//! wick-media: images and audio clips from untrusted bytes to the tensors a model's towers
//! read, computed as transformers' processors compute them.
//!
//! - [`image`]: [`decode_image`] sniffs the format (PNG, JPEG, WebP, GIF, BMP, TIFF), checks
//!   the declared size against [`ImageLimits`] before allocating, applies EXIF orientation
//!   and drops transparency (as transformers' `load_image`); [`probe_image`] reads only the
//!   header, and [`ImageProcessor::layout`] tells from it what the image will cost;
//!   [`ImageProcessor`] resizes with Pillow's exact fixed-point resampling and rescales /
//!   normalises into channels-first `f32`.
//! - [`audio`]: [`decode_audio`] reads WAV, MP3, FLAC and Ogg Vorbis into mono samples (the
//!   channels averaged, at most [`AudioLimits::max_seconds`] kept), [`resample`] brings them
//!   to the feature extractor's rate and [`MelConfig`] computes Gemma 4's log-mel features.
//!
//! Nothing here knows HTTP or the engine: the server wraps the plain vectors in the
//! engine's media types.
//!
//! ```
//! use wick_media::{decode_image, ImageLimits, ImageProcessor};
//!
//! // A 2×1 BMP, made by hand: one red pixel, one blue one.
//! let mut bmp = Vec::new();
//! bmp.extend_from_slice(b"BM");
//! bmp.extend_from_slice(&(54u32 + 8).to_le_bytes());
//! bmp.extend_from_slice(&[0, 0, 0, 0]);
//! bmp.extend_from_slice(&54u32.to_le_bytes());
//! bmp.extend_from_slice(&40u32.to_le_bytes());
//! bmp.extend_from_slice(&2i32.to_le_bytes());
//! bmp.extend_from_slice(&1i32.to_le_bytes());
//! bmp.extend_from_slice(&1u16.to_le_bytes());
//! bmp.extend_from_slice(&24u16.to_le_bytes());
//! bmp.extend_from_slice(&[0; 24]);
//! bmp.extend_from_slice(&[0, 0, 255, 255, 0, 0, 0, 0]); // BGR, BGR, row padding
//!
//! let image = decode_image(&bmp, &ImageLimits::default()).unwrap();
//! assert_eq!((image.width, image.height), (2, 1));
//! let pixels = ImageProcessor::Gemma3 { size: 4 }.process(&image).unwrap();
//! assert_eq!(pixels.data.len(), 3 * 4 * 4);
//! assert!(pixels.data.iter().all(|v| (-1.0..=1.0).contains(v)));
//! ```
#![warn(missing_docs)]

pub mod audio;
pub mod error;
pub mod image;

/// The image formats [`sniff_image`] tells apart (the `image` crate's enum).
pub use ::image::ImageFormat;
pub use audio::decode::{decode_audio, AudioFormat, AudioLimits, MonoClip, AUDIO_FORMATS};
pub use audio::mel::{MelConfig, MelFeatures};
pub use audio::resample::resample;
pub use error::MediaError;
pub use image::decode::{
    decode_image, probe_image, sniff_image, ImageHeader, ImageLimits, RgbImage, IMAGE_FORMATS,
};
pub use image::processor::{
    gemma4_target_size, qwen_target_size, ImageProcessor, Layout, ProcessedImage, MAX_OUTPUT_PIXELS,
};

/// An audio clip ready for Gemma 4's audio tower.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedAudio {
    /// The log-mel features.
    pub features: MelFeatures,
    /// Soft tokens the clip takes in the prompt.
    pub soft_tokens: usize,
    /// Whether the clip was cut to the longest duration kept.
    pub truncated: bool,
}

/// Decodes an audio clip, mixes it to mono, resamples it to `config.sample_rate` and
/// computes its features.
pub fn prepare_audio(
    bytes: &[u8],
    limits: &AudioLimits,
    config: &MelConfig,
) -> Result<PreparedAudio, MediaError> {
    config.check()?;
    let clip = decode_audio(bytes, limits)?;
    let samples = resample(&clip.samples, clip.rate, config.sample_rate)?;
    let truncated = clip.truncated || samples.len() > config.max_samples;
    let features = config.features(&samples);
    let soft_tokens = features.soft_tokens();
    Ok(PreparedAudio {
        features,
        soft_tokens,
        truncated,
    })
}
