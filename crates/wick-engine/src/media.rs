//! Images and audio in a prompt: what the server hands the engine, and what a loaded model
//! says it can read.
//!
//! The server decodes and preprocesses media (`wick-media`: pixels after the model's image
//! processor, log-mel features after its feature extractor), expands each media marker of
//! the rendered prompt into the model's begin / soft / end tokens, and attaches one
//! [`MediaSpan`] per item to the [`crate::GenerationRequest`]. The engine runs the tower on
//! the item, projects it into the text model's embedding space, and the embeddings replace
//! the rows of the span's soft tokens during prefill.
use std::borrow::Cow;
use std::sync::Arc;

/// Pixel values of one image after the model's processor, channels first `[c, h, w]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePixels {
    /// Channels (3).
    pub channels: usize,
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
    /// `channels × height × width` values, row-major per channel.
    pub data: Arc<[f32]>,
}

/// Log-mel features of one audio clip after the model's feature extractor, `[frames, bins]`.
/// Every frame counts as real audio: the extractor's trailing frames that end in its
/// padding (zeroed, reaching no soft token) are left out.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioFeatures {
    /// Frames (time steps) that hold samples.
    pub frames: usize,
    /// Mel bins per frame.
    pub bins: usize,
    /// `frames × bins` values, frame-major.
    pub data: Arc<[f32]>,
}

/// What a media item is.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaData {
    /// An image for the vision tower.
    Image(ImagePixels),
    /// An audio clip for the audio tower.
    Audio(AudioFeatures),
}

/// One media item placed in the prompt: its embeddings replace prompt positions
/// `start .. start + len` (the item's soft tokens; the begin/end tokens around them are
/// ordinary text tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct MediaSpan {
    /// First soft-token position in the prompt.
    pub start: usize,
    /// Number of soft tokens (the tower's output rows for this item).
    pub len: usize,
    /// The preprocessed item.
    pub data: MediaData,
    /// A hash of the preprocessed values (XXH3-64 of the f32 bytes): the prompt cache keys
    /// the span's positions by it, so two different images never share cached KV.
    pub digest: u64,
}

/// The image processor a model's vision tower expects (the server prepares pixels with it).
#[derive(Debug, Clone, PartialEq)]
pub enum VisionProcessor {
    /// Gemma 3 (SigLIP): resized to `size × size` without keeping the aspect ratio,
    /// `(x / 255 − mean) / std`; a fixed number of soft tokens per image.
    Gemma3 {
        /// Side of the square image the tower reads.
        size: usize,
    },
    /// Gemma 4: aspect-preserving resize to multiples of `patch × pool` pixels within
    /// `max_patches` patches, scaled by 1/255; soft tokens depend on the image's size.
    Gemma4 {
        /// Patch side in pixels.
        patch: usize,
        /// Pooling factor per side (soft token = `pool × pool` patches).
        pool: usize,
        /// Most patches per image.
        max_patches: usize,
    },
    /// Qwen-VL (`Qwen2VLImageProcessor`): "smart resize" keeping the aspect ratio to
    /// multiples of `patch × merge` pixels within `min_pixels ..= max_pixels` (bicubic), then
    /// `(x / 255 − mean) / std`; one soft token per `merge × merge` patches.
    Qwen {
        /// Patch side in pixels.
        patch: usize,
        /// Frames per patch cube (a still image repeats its frame).
        temporal_patch: usize,
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

/// What a model's vision tower reads and how its soft tokens look in a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionCaps {
    /// How pixels are prepared.
    pub processor: VisionProcessor,
    /// Soft tokens per image for fixed-size towers (`None`: depends on the image).
    pub tokens_per_image: Option<usize>,
    /// The soft token each image row stands for in the prompt.
    pub image_token_id: u32,
    /// Begin-of-image token.
    pub boi_token_id: u32,
    /// End-of-image token.
    pub eoi_token_id: u32,
}

/// What a model's audio tower reads and how its soft tokens look in a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioCaps {
    /// Input sample rate in Hz.
    pub sample_rate: u32,
    /// Mel bins per frame.
    pub mel_bins: usize,
    /// Most soft tokens per clip.
    pub max_tokens: usize,
    /// The soft token each audio row stands for in the prompt.
    pub audio_token_id: u32,
    /// Begin-of-audio token.
    pub boa_token_id: u32,
    /// End-of-audio token.
    pub eoa_token_id: u32,
}

/// The media a loaded model can read: a tower is listed only when its weights loaded.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MediaCaps {
    /// The vision tower, when present.
    pub vision: Option<VisionCaps>,
    /// The audio tower, when present.
    pub audio: Option<AudioCaps>,
}

impl MediaCaps {
    /// Text only.
    pub fn none() -> Self {
        MediaCaps::default()
    }
}

/// The tokens a prompt is cached under: `tokens` with each media span's positions replaced
/// by ids derived from the span's digest (with the high bit set, outside any vocabulary), so
/// that two prompts with the same soft tokens but different images share no cached KV past
/// the first image, while a text prefix before it still matches.
pub fn cache_key_tokens<'a>(tokens: &'a [u32], media: &[MediaSpan]) -> Cow<'a, [u32]> {
    if media.is_empty() {
        return Cow::Borrowed(tokens);
    }
    let mut keyed = tokens.to_vec();
    for span in media {
        let seed = (span.digest ^ (span.digest >> 32)) as u32;
        let end = (span.start + span.len).min(keyed.len());
        for (i, t) in keyed.iter_mut().enumerate().take(end).skip(span.start) {
            *t = 0x8000_0000
                | (seed
                    .wrapping_add((i - span.start) as u32)
                    .wrapping_mul(0x9E37_79B1)
                    >> 1);
        }
    }
    Cow::Owned(keyed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(start: usize, digest: u64) -> MediaSpan {
        MediaSpan {
            start,
            len: 2,
            data: MediaData::Audio(AudioFeatures {
                frames: 0,
                bins: 0,
                data: Arc::from(Vec::new()),
            }),
            digest,
        }
    }

    #[test]
    fn different_images_key_differently_after_the_text_prefix() {
        let tokens = [1, 2, 9, 9, 3];
        let a = cache_key_tokens(&tokens, &[span(2, 7)]);
        let b = cache_key_tokens(&tokens, &[span(2, 8)]);
        assert_eq!(a[..2], tokens[..2]);
        assert_ne!(a[2..4], b[2..4]);
        assert_eq!(a[4], 3);
        assert!(a[2] >= 0x8000_0000);
        assert_eq!(cache_key_tokens(&tokens, &[]), Cow::Borrowed(&tokens[..]));
    }
}
