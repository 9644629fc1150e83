//! Images and audio in chat requests: the parts every protocol brings (as OpenAI chat
//! parts, [`parts`]), the policy that bounds them ([`MediaPolicy`]), fetching URLs safely
//! ([`fetch`]), decoding and preprocessing off the async runtime (`wick-media`), and
//! splicing the model's media tokens into the rendered prompt ([`splice`]).
//!
//! The flow, from [`crate::prepare::chat::prepare`]: [`parts::extract`] swaps each media
//! part of the messages for the `{"type": "image"}` / `{"type": "audio"}` item chat
//! templates expect and collects its source; [`check_towers`] refuses media the served
//! model cannot read (400 naming the model); [`load_all`] fetches every item, counts the
//! images' soft tokens from their headers (a request they alone overflow is refused before
//! any pixel is decoded), then decodes and preprocesses the items on blocking workers, at
//! most one per core across all requests; [`crate::prepare::prompt::chat_prompt`] renders,
//! expands each template marker into the item's begin / soft / end tokens and tokenizes,
//! and [`splice::spans`] places one [`wick_engine::media::MediaSpan`] per item.
pub mod fetch;
pub mod parts;
pub mod splice;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use tokio::sync::Semaphore;
use wick_engine::media::{
    AudioFeatures, ImagePixels, MediaCaps, MediaData, VisionCaps, VisionProcessor,
};
use wick_media::{
    decode_image, prepare_audio, probe_image, AudioLimits, ImageLimits, ImageProcessor, MediaError,
    MelConfig,
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

/// Media items being decoded and preprocessed at once, across every request: one per core.
/// An image's decode holds its pixels several times over (an 8000×5000 RGBA PNG with 16-bit
/// channels holds 440 MB at its peak), so eight such images in one request, or in eight
/// requests, wait their turn instead of all being in memory at once.
static DECODE_SLOTS: LazyLock<Arc<Semaphore>> = LazyLock::new(|| {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Arc::new(Semaphore::new(cores))
});

/// Fetches every item, reads what each will cost from its header and refuses the request
/// when the items' soft tokens alone fill the model's `context` (nothing has been decoded
/// yet); then decodes and preprocesses the items on blocking workers (never on the async
/// runtime's threads, never on the engine's), at most one per core across all requests.
pub async fn load_all(
    items: Vec<MediaRef>,
    caps: MediaCaps,
    policy: Arc<MediaPolicy>,
    context: usize,
) -> Result<Vec<LoadedMedia>, ApiError> {
    let caps = Arc::new(caps);
    let probes = items.into_iter().map(|item| {
        let caps = caps.clone();
        let policy = policy.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let bytes = fetch_bytes(&item, &policy)?;
                let tokens = soft_tokens_from_header(&item, &bytes, &caps, &policy)?;
                Ok::<_, ApiError>((item, bytes, tokens))
            })
            .await
            .map_err(|e| ApiError::Internal(format!("media worker failed: {e}")))?
        }
    });
    let probed = futures_util::future::try_join_all(probes).await?;
    let tokens: usize = probed.iter().map(|(_, _, t)| t).sum();
    if tokens >= context {
        // The prompt holds at least these tokens: refused as a prompt that fills the
        // context is, before any pixels exist.
        return Err(ApiError::ContextOverflow {
            param: "messages",
            prompt: tokens,
            max_tokens: 1,
            needed: tokens + 1,
            limit: context,
        });
    }
    let loads = probed.into_iter().map(|(item, bytes, _)| {
        let caps = caps.clone();
        let policy = policy.clone();
        async move {
            let slot = DECODE_SLOTS
                .clone()
                .acquire_owned()
                .await
                .map_err(|e| ApiError::Internal(format!("media decoding closed: {e}")))?;
            tokio::task::spawn_blocking(move || {
                let _slot = slot;
                prepare(&item, &bytes, &caps, &policy)
            })
            .await
            .map_err(|e| ApiError::Internal(format!("media worker failed: {e}")))?
        }
    });
    futures_util::future::try_join_all(loads).await
}

/// One item's bytes, decoded and preprocessed for the model's tower.
pub fn load(
    item: &MediaRef,
    caps: &MediaCaps,
    policy: &MediaPolicy,
) -> Result<LoadedMedia, ApiError> {
    let bytes = fetch_bytes(item, policy)?;
    prepare(item, &bytes, caps, policy)
}

/// An item's encoded bytes: fetched, or decoded from base64.
fn fetch_bytes(item: &MediaRef, policy: &MediaPolicy) -> Result<Vec<u8>, ApiError> {
    let max_bytes = match item.kind {
        MediaKind::Image => policy.image.max_bytes,
        MediaKind::Audio => policy.audio.max_bytes,
    };
    match &item.source {
        MediaSource::Url(url) => fetch::fetch(url, policy, max_bytes)
            .map_err(|e| ApiError::field(item.at.clone(), e.to_string())),
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
            parts::decode_data_url(&item.at, url)
        }
        MediaSource::Base64(data) => parts::decode_base64(&item.at, data),
    }
}

/// A media error as the API tells it: the model's settings are the server's fault (500),
/// anything else is the item's (400 naming the part).
fn media_error(item: &MediaRef, e: MediaError) -> ApiError {
    match e {
        MediaError::Config(_) => ApiError::Internal(e.to_string()),
        e => ApiError::field(item.at.clone(), e.to_string()),
    }
}

/// The soft tokens an item takes at least, from its header alone: an image's, from its
/// size and the tower's processor (its size and pixel limits are checked on the way);
/// a clip's are known once it is decoded, so it counts none here.
fn soft_tokens_from_header(
    item: &MediaRef,
    bytes: &[u8],
    caps: &MediaCaps,
    policy: &MediaPolicy,
) -> Result<usize, ApiError> {
    if item.kind != MediaKind::Image {
        return Ok(0);
    }
    let vision = caps
        .vision
        .as_ref()
        .ok_or_else(|| ApiError::unsupported(item.at.clone(), "the model has no vision tower"))?;
    let header = probe_image(bytes, &policy.image).map_err(|e| media_error(item, e))?;
    let layout = image_processor(vision)
        .layout(header.width as usize, header.height as usize)
        .map_err(|e| media_error(item, e))?;
    Ok(vision.tokens_per_image.or(layout.soft_tokens).unwrap_or(0))
}

/// An item's bytes, decoded and preprocessed for the model's tower.
fn prepare(
    item: &MediaRef,
    bytes: &[u8],
    caps: &MediaCaps,
    policy: &MediaPolicy,
) -> Result<LoadedMedia, ApiError> {
    let bad = |e: MediaError| media_error(item, e);
    match item.kind {
        MediaKind::Image => {
            let vision = caps.vision.as_ref().ok_or_else(|| {
                ApiError::unsupported(item.at.clone(), "the model has no vision tower")
            })?;
            let image = decode_image(bytes, &policy.image).map_err(bad)?;
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
            let prepared = prepare_audio(bytes, &policy.audio, &config).map_err(bad)?;
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

#[cfg(test)]
mod tests {
    use base64::Engine as _;

    use super::*;

    /// A tower reading images as Qwen2.5-VL does by default (up to 12.8 megapixels, 16,384
    /// soft tokens per image).
    fn qwen_caps(std: [f32; 3]) -> MediaCaps {
        MediaCaps {
            vision: Some(VisionCaps {
                processor: VisionProcessor::Qwen {
                    patch: 14,
                    temporal_patch: 2,
                    merge: 2,
                    min_pixels: 3136,
                    max_pixels: 12_845_056,
                    mean: [0.5; 3],
                    std,
                },
                tokens_per_image: None,
                image_token_id: 1,
                boi_token_id: 2,
                eoi_token_id: 3,
            }),
            audio: None,
        }
    }

    fn image_item(i: usize, bytes: &[u8]) -> MediaRef {
        let data = base64::engine::general_purpose::STANDARD.encode(bytes);
        MediaRef {
            kind: MediaKind::Image,
            source: MediaSource::DataUrl(format!("data:image/png;base64,{data}")),
            at: format!("messages[0].content[{i}]"),
        }
    }

    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    /// A PNG declaring `width × height` RGB pixels whose data is not even compressed: its
    /// header reads, its pixels never decode.
    fn png_without_pixels(width: u32, height: u32) -> Vec<u8> {
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&width.to_be_bytes());
        ihdr.extend_from_slice(&height.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
        for (tag, data) in [
            (&b"IHDR"[..], &ihdr[..]),
            (b"IDAT", b"not zlib, not pixels"),
            (b"IEND", b""),
        ] {
            out.extend_from_slice(&(data.len() as u32).to_be_bytes());
            let mut body = tag.to_vec();
            body.extend_from_slice(data);
            out.extend_from_slice(&body);
            out.extend_from_slice(&crc32(&body).to_be_bytes());
        }
        out
    }

    fn real_png() -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../wick-media/tests/data/alpha.png");
        std::fs::read(path).unwrap()
    }

    /// Eight 8000×5000 images were all decoded and resized (3.2 GB at the peak) before the
    /// context check refused them; their headers already say they take 8 × 16,261 soft
    /// tokens. These PNGs have no decodable pixels: a decode would fail with another error.
    #[tokio::test]
    async fn images_that_overflow_the_context_are_refused_from_their_headers() {
        let items = (0..8)
            .map(|i| image_item(i, &png_without_pixels(8000, 5000)))
            .collect();
        let policy = Arc::new(MediaPolicy::default());
        let err = load_all(items, qwen_caps([0.5; 3]), policy, 32_768)
            .await
            .unwrap_err();
        match err {
            ApiError::ContextOverflow { prompt, limit, .. } => {
                assert_eq!((prompt, limit), (8 * 16_261, 32_768));
            }
            other => panic!("{other:?}"),
        }
    }

    /// Decoding waits for one of the process-wide slots (one per core): with every slot
    /// taken, a request's image is not decoded until one is given back.
    #[tokio::test]
    async fn decoding_waits_for_a_slot() {
        let slots = DECODE_SLOTS.clone();
        let all =
            u32::try_from(std::thread::available_parallelism().map_or(1, |n| n.get())).unwrap();
        let held = slots.clone().acquire_many_owned(all).await.unwrap();
        let policy = Arc::new(MediaPolicy::default());
        let load = tokio::spawn(load_all(
            vec![image_item(0, &real_png())],
            qwen_caps([0.5; 3]),
            policy,
            32_768,
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!load.is_finished(), "decoded without a slot");
        drop(held);
        let loaded = load.await.unwrap().unwrap();
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].soft_tokens, 4);
    }

    /// A model whose image processor divides by a zero standard deviation is the server's
    /// fault: a 500 saying so, never infinite pixels.
    #[tokio::test]
    async fn a_broken_processor_config_is_a_server_error() {
        let policy = Arc::new(MediaPolicy::default());
        let err = load_all(
            vec![image_item(0, &real_png())],
            qwen_caps([0.0; 3]),
            policy,
            32_768,
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, ApiError::Internal(m) if m.contains("std")),
            "{err:?}"
        );
    }
}
