//! Images and audio in chat requests: the parts every protocol brings (as OpenAI chat
//! parts, [`parts`]), the policy that bounds them ([`MediaPolicy`]), fetching URLs safely
//! ([`fetch`]), decoding and preprocessing off the async runtime (`wick-media`), and
//! splicing the model's media tokens into the rendered prompt ([`splice`]).
//!
//! The flow, from [`crate::prepare::chat::prepare`]: [`parts::extract`] swaps each media
//! part of the messages for the `{"type": "image"}` / `{"type": "audio"}` item chat
//! templates expect and collects its source; [`check_towers`] refuses media the served
//! model cannot read (400 naming the model); [`load_all`] fetches, decodes and
//! preprocesses every item on blocking workers; [`crate::prepare::prompt::chat_prompt`] renders,
//! expands each template marker into the item's begin / soft / end tokens and tokenizes,
//! and [`splice::spans`] places one [`wick_engine::media::MediaSpan`] per item.
pub mod fetch;
pub mod parts;
pub mod splice;

use std::sync::Arc;
use std::time::Duration;

use wick_engine::media::{
    AudioFeatures, ImagePixels, MediaCaps, MediaData, VisionCaps, VisionProcessor,
};
use wick_media::{
    decode_image, prepare_audio, AudioLimits, ImageLimits, ImageProcessor, MediaError, MelConfig,
};

use crate::error::ApiError;
pub use parts::{MediaKind, MediaRef, MediaSource};

/// Most media items one request may carry, unless configured.
pub const DEFAULT_MAX_MEDIA_ITEMS: usize = 8;
/// Largest fetched or inline media item, in bytes.
pub const DEFAULT_MAX_MEDIA_BYTES: usize = 20 * 1024 * 1024;
/// Time a URL fetch may take, redirects included.
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Redirects a URL fetch follows (each hop's address re-checked).
pub const DEFAULT_MAX_REDIRECTS: u32 = 3;

/// What media a request may bring and how URLs are fetched.
#[derive(Debug, Clone, PartialEq)]
pub struct MediaPolicy {
    /// Most media items per request.
    pub max_items: usize,
    /// Image size limits (encoded bytes, sides, pixels).
    pub image: ImageLimits,
    /// Audio limits (encoded bytes, seconds kept).
    pub audio: AudioLimits,
    /// Fetch URLs that resolve to loopback, private, link-local, unique-local,
    /// unspecified or multicast addresses (`--allow-private-media`).
    pub allow_private: bool,
    /// Time limit of a fetch.
    pub fetch_timeout: Duration,
    /// Redirects followed.
    pub max_redirects: u32,
}

impl Default for MediaPolicy {
    fn default() -> Self {
        MediaPolicy {
            max_items: DEFAULT_MAX_MEDIA_ITEMS,
            image: ImageLimits {
                max_bytes: DEFAULT_MAX_MEDIA_BYTES,
                ..ImageLimits::default()
            },
            audio: AudioLimits {
                max_bytes: DEFAULT_MAX_MEDIA_BYTES,
                ..AudioLimits::default()
            },
            allow_private: false,
            fetch_timeout: DEFAULT_FETCH_TIMEOUT,
            max_redirects: DEFAULT_MAX_REDIRECTS,
        }
    }
}

/// One item after preprocessing: what the engine reads and how many soft tokens it takes.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedMedia {
    /// The kind (which marker it fills).
    pub kind: MediaKind,
    /// Pixels or features.
    pub data: MediaData,
    /// Soft tokens in the prompt.
    pub soft_tokens: usize,
}

/// Refuses media the served model has no tower for, and more items than the policy allows;
/// errors name the model and the part.
pub fn check_towers(
    items: &[MediaRef],
    caps: &MediaCaps,
    model_id: &str,
    policy: &MediaPolicy,
) -> Result<(), ApiError> {
    for item in items {
        let (present, what) = match item.kind {
            MediaKind::Image => (caps.vision.is_some(), "vision tower: it cannot read images"),
            MediaKind::Audio => (caps.audio.is_some(), "audio tower: it cannot read audio"),
        };
        if !present {
            return Err(ApiError::unsupported(
                format!("{}.type", item.at),
                format!("model '{model_id}' has no {what}"),
            ));
        }
    }
    if items.len() > policy.max_items {
        return Err(ApiError::field(
            "messages",
            format!(
                "{} media items in one request, more than the limit of {}",
                items.len(),
                policy.max_items
            ),
        ));
    }
    Ok(())
}

/// Fetches, decodes and preprocesses every item on blocking workers (never on the async
/// runtime's threads, never on the engine's).
pub async fn load_all(
    items: Vec<MediaRef>,
    caps: MediaCaps,
    policy: Arc<MediaPolicy>,
) -> Result<Vec<LoadedMedia>, ApiError> {
    let tasks: Vec<_> = items
        .into_iter()
        .map(|item| {
            let caps = caps.clone();
            let policy = policy.clone();
            tokio::task::spawn_blocking(move || load(&item, &caps, &policy))
        })
        .collect();
    let mut loaded = Vec::with_capacity(tasks.len());
    for task in tasks {
        let item = task
            .await
            .map_err(|e| ApiError::Internal(format!("media worker failed: {e}")))??;
        loaded.push(item);
    }
    Ok(loaded)
}

/// One item's bytes, decoded and preprocessed for the model's tower.
pub fn load(
    item: &MediaRef,
    caps: &MediaCaps,
    policy: &MediaPolicy,
) -> Result<LoadedMedia, ApiError> {
    let bad = |e: MediaError| ApiError::field(item.at.clone(), e.to_string());
    let max_bytes = match item.kind {
        MediaKind::Image => policy.image.max_bytes,
        MediaKind::Audio => policy.audio.max_bytes,
    };
    let bytes = match &item.source {
        MediaSource::Url(url) => fetch::fetch(url, policy, max_bytes)
            .map_err(|e| ApiError::field(item.at.clone(), e.to_string()))?,
        MediaSource::DataUrl(url) => {
            // An image part's data must say it is an image (or say nothing): a PDF, a clip
            // or text sent as an image is the client's mistake, told as such. Among image
            // types the bytes decide (clients often label every image image/jpeg).
            let declared = parts::data_url_type(url);
            if item.kind == MediaKind::Image
                && !(declared.is_empty()
                    || declared == "application/octet-stream"
                    || declared.starts_with("image/"))
            {
                return Err(ApiError::field(
                    item.at.clone(),
                    format!("the data: URL's type '{declared}' is not an image type"),
                ));
            }
            parts::decode_data_url(&item.at, url)?
        }
        MediaSource::Base64(data) => parts::decode_base64(&item.at, data)?,
    };
    match item.kind {
        MediaKind::Image => {
            let vision = caps.vision.as_ref().ok_or_else(|| {
                ApiError::unsupported(item.at.clone(), "the model has no vision tower")
            })?;
            let image = decode_image(&bytes, &policy.image).map_err(bad)?;
            let processed = image_processor(vision).process(&image).map_err(bad)?;
            let soft_tokens = vision
                .tokens_per_image
                .or(processed.soft_tokens)
                .unwrap_or(0);
            Ok(LoadedMedia {
                kind: MediaKind::Image,
                soft_tokens,
                data: MediaData::Image(ImagePixels {
                    channels: processed.channels,
                    height: processed.height,
                    width: processed.width,
                    data: Arc::from(processed.data),
                }),
            })
        }
        MediaKind::Audio => {
            let audio = caps.audio.as_ref().ok_or_else(|| {
                ApiError::unsupported(item.at.clone(), "the model has no audio tower")
            })?;
            let config = MelConfig {
                sample_rate: audio.sample_rate,
                bins: audio.mel_bins,
                ..MelConfig::default()
            };
            let prepared = prepare_audio(&bytes, &policy.audio, &config).map_err(bad)?;
            if prepared.truncated {
                tracing::warn!(
                    at = %item.at,
                    seconds = policy.audio.max_seconds,
                    "audio clip truncated to the longest duration the model reads"
                );
            }
            let mut features = prepared.features;
            // The tower reads the frames that hold samples (a prefix): the extractor's
            // trailing padded frames are zero and reach no soft token.
            let real = features.mask.iter().take_while(|&&m| m).count();
            if real == 0 || prepared.soft_tokens == 0 {
                return Err(ApiError::field(
                    item.at.clone(),
                    "the audio clip is too short: it holds no complete 20 ms frame",
                ));
            }
            features.data.truncate(real * features.bins);
            Ok(LoadedMedia {
                kind: MediaKind::Audio,
                soft_tokens: prepared.soft_tokens.min(audio.max_tokens),
                data: MediaData::Audio(AudioFeatures {
                    frames: real,
                    bins: features.bins,
                    data: Arc::from(features.data),
                }),
            })
        }
    }
}

/// The `wick-media` processor for a tower's [`VisionProcessor`].
fn image_processor(vision: &VisionCaps) -> ImageProcessor {
    match vision.processor {
        VisionProcessor::Gemma3 { size } => ImageProcessor::Gemma3 { size },
        VisionProcessor::Gemma4 {
            patch,
            pool,
            max_patches,
        } => ImageProcessor::Gemma4 {
            patch,
            pool,
            max_patches,
        },
        VisionProcessor::Qwen {
            patch,
            merge,
            min_pixels,
            max_pixels,
            mean,
            std,
            ..
        } => ImageProcessor::Qwen {
            patch,
            merge,
            min_pixels,
            max_pixels,
            mean,
            std,
        },
    }
}

/// XXH3-64 of an item's `f32` values (the prompt cache keys its positions by it).
pub fn digest(data: &MediaData) -> u64 {
    let values: &[f32] = match data {
        MediaData::Image(p) => &p.data,
        MediaData::Audio(a) => &a.data,
    };
    let mut bytes = Vec::with_capacity(values.len() * 4);
    for v in values {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&bytes)
}
