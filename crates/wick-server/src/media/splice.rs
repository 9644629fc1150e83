//! Splicing media into a rendered prompt, as the models' processors do: each marker the
//! chat template wrote for a media item is replaced by the item's begin token, one soft
//! token per tower output row and the end token (Gemma 3 also puts a blank line on each
//! side), then the text is tokenized and each run of soft tokens becomes a
//! [`MediaSpan`]. User text never yields these tokens (its special-token text is marked and
//! tokenized as plain text), so every run found is one the splice made.
use wick_engine::media::{MediaCaps, MediaSpan, VisionProcessor};

use super::{digest, LoadedMedia, MediaKind};
use crate::error::ApiError;

/// How one kind of item looks in a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemTokens {
    /// The text the chat template writes for an item.
    pub marker: String,
    /// Text before the soft tokens (the begin token).
    pub prefix: String,
    /// One soft token's text.
    pub soft: String,
    /// Its id.
    pub soft_id: u32,
    /// Text after the soft tokens (the end token).
    pub suffix: String,
}

/// The prompt forms of a model's media, from its capabilities and token texts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MediaTokens {
    /// Images, when the model has a vision tower.
    pub image: Option<ItemTokens>,
    /// Audio, when the model has an audio tower.
    pub audio: Option<ItemTokens>,
}

impl MediaTokens {
    /// The forms for `caps`; `text_of` gives a token id's text.
    pub fn new(
        caps: &MediaCaps,
        text_of: impl Fn(u32) -> Option<String>,
    ) -> Result<Self, ApiError> {
        let token = |id: u32| {
            text_of(id).ok_or_else(|| {
                ApiError::Internal(format!("media token id {id} is not in the vocabulary"))
            })
        };
        let image = match &caps.vision {
            None => None,
            Some(v) => {
                let (boi, soft, eoi) = (
                    token(v.boi_token_id)?,
                    token(v.image_token_id)?,
                    token(v.eoi_token_id)?,
                );
                Some(match v.processor {
                    // Gemma 3's template writes `<start_of_image>`; its processor makes it
                    // `\n\n<start_of_image><image_soft_token>×n<end_of_image>\n\n`.
                    VisionProcessor::Gemma3 { .. } => ItemTokens {
                        marker: boi.clone(),
                        prefix: format!("\n\n{boi}"),
                        soft,
                        soft_id: v.image_token_id,
                        suffix: format!("{eoi}\n\n"),
                    },
                    // Gemma 4's template writes the soft token once: `<|image|>`.
                    VisionProcessor::Gemma4 { .. } => ItemTokens {
                        marker: soft.clone(),
                        prefix: boi,
                        soft,
                        soft_id: v.image_token_id,
                        suffix: eoi,
                    },
                    // Qwen's template writes `<|vision_start|><|image_pad|><|vision_end|>`
                    // itself; its processor repeats the pad once per merged patch window.
                    VisionProcessor::Qwen { .. } => ItemTokens {
                        marker: soft.clone(),
                        prefix: String::new(),
                        soft,
                        soft_id: v.image_token_id,
                        suffix: String::new(),
                    },
                })
            }
        };
        let audio = match &caps.audio {
            None => None,
            Some(a) => {
                let soft = token(a.audio_token_id)?;
                Some(ItemTokens {
                    marker: soft.clone(),
                    prefix: token(a.boa_token_id)?,
                    soft,
                    soft_id: a.audio_token_id,
                    suffix: token(a.eoa_token_id)?,
                })
            }
        };
        Ok(MediaTokens { image, audio })
    }

    fn of(&self, kind: MediaKind) -> Option<&ItemTokens> {
        match kind {
            MediaKind::Image => self.image.as_ref(),
            MediaKind::Audio => self.audio.as_ref(),
        }
    }
}

/// Replaces the template's markers in `text`, in order, by each item's tokens. An occurrence
/// right after `user_mark` is user text and stays. Markers and items must pair up in kind
/// and number.
pub fn expand(
    text: &str,
    user_mark: Option<char>,
    items: &[LoadedMedia],
    tokens: &MediaTokens,
) -> Result<String, ApiError> {
    let forms: Vec<(MediaKind, &ItemTokens)> = [MediaKind::Image, MediaKind::Audio]
        .into_iter()
        .filter_map(|k| tokens.of(k).map(|t| (k, t)))
        .collect();
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut next = items.iter();
    let mut found = 0usize;
    loop {
        // The earliest marker of any kind.
        let hit = forms
            .iter()
            .filter_map(|(k, t)| rest.find(&t.marker).map(|at| (at, *k, *t)))
            .min_by_key(|(at, _, _)| *at);
        let Some((at, kind, form)) = hit else { break };
        let user_typed = user_mark.is_some_and(|m| rest[..at].ends_with(m));
        out.push_str(&rest[..at]);
        rest = &rest[at + form.marker.len()..];
        if user_typed {
            out.push_str(&form.marker);
            continue;
        }
        found += 1;
        let Some(item) = next.next() else {
            return Err(mismatch(found, items.len()));
        };
        if item.kind != kind {
            return Err(ApiError::field(
                "messages",
                format!(
                    "the chat template placed media in a different order than the request's parts (marker {found} is {kind:?}, part is {:?})",
                    item.kind
                ),
            ));
        }
        out.push_str(&form.prefix);
        for _ in 0..item.soft_tokens {
            out.push_str(&form.soft);
        }
        out.push_str(&form.suffix);
    }
    out.push_str(rest);
    if found != items.len() {
        return Err(mismatch(found, items.len()));
    }
    Ok(out)
}

fn mismatch(found: usize, items: usize) -> ApiError {
    ApiError::field(
        "messages",
        format!(
            "the rendered prompt has {found} media markers for {items} media parts; the chat template must render every image and audio part"
        ),
    )
}

/// One span per item over the tokenized prompt: the `i`-th run of soft tokens of the
/// item's kind, which must be exactly as long as the item's soft token count.
pub fn spans(
    ids: &[u32],
    items: Vec<LoadedMedia>,
    tokens: &MediaTokens,
) -> Result<Vec<MediaSpan>, ApiError> {
    let mut spans = Vec::with_capacity(items.len());
    let mut pos = 0usize;
    for item in items {
        let Some(form) = tokens.of(item.kind) else {
            return Err(ApiError::Internal("media kind without tokens".into()));
        };
        let Some(offset) = ids[pos..].iter().position(|&t| t == form.soft_id) else {
            return Err(ApiError::Internal(format!(
                "media item {} has no soft tokens in the tokenized prompt",
                spans.len()
            )));
        };
        let start = pos + offset;
        let len = ids[start..]
            .iter()
            .take_while(|&&t| t == form.soft_id)
            .count();
        if len != item.soft_tokens {
            return Err(ApiError::Internal(format!(
                "media item {} spans {len} soft tokens, expected {}",
                spans.len(),
                item.soft_tokens
            )));
        }
        pos = start + len;
        let digest = digest(&item.data);
        spans.push(MediaSpan {
            start,
            len,
            data: item.data,
            digest,
        });
    }
    Ok(spans)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use wick_engine::media::{AudioCaps, ImagePixels, MediaData, VisionCaps};

    use super::*;

    fn gemma3_caps() -> MediaCaps {
        MediaCaps {
            vision: Some(VisionCaps {
                processor: VisionProcessor::Gemma3 { size: 896 },
                tokens_per_image: Some(3),
                image_token_id: 262144,
                boi_token_id: 255999,
                eoi_token_id: 256000,
            }),
            audio: None,
        }
    }

    fn gemma4_caps() -> MediaCaps {
        MediaCaps {
            vision: Some(VisionCaps {
                processor: VisionProcessor::Gemma4 {
                    patch: 16,
                    pool: 3,
                    max_patches: 2520,
                },
                tokens_per_image: None,
                image_token_id: 10,
                boi_token_id: 11,
                eoi_token_id: 12,
            }),
            audio: Some(AudioCaps {
                sample_rate: 16000,
                mel_bins: 128,
                max_tokens: 750,
                audio_token_id: 20,
                boa_token_id: 21,
                eoa_token_id: 22,
            }),
        }
    }

    fn text_of(id: u32) -> Option<String> {
        Some(
            match id {
                262144 => "<image_soft_token>",
                255999 => "<start_of_image>",
                256000 => "<end_of_image>",
                10 => "<|image|>",
                11 => "<|image>",
                12 => "<image|>",
                20 => "<|audio|>",
                21 => "<|audio>",
                22 => "<audio|>",
                _ => return None,
            }
            .to_string(),
        )
    }

    fn item(kind: MediaKind, soft_tokens: usize, value: f32) -> LoadedMedia {
        LoadedMedia {
            kind,
            soft_tokens,
            data: MediaData::Image(ImagePixels {
                channels: 3,
                height: 1,
                width: 1,
                data: Arc::from(vec![value; 3]),
            }),
        }
    }

    #[test]
    fn gemma3_markers_get_blank_lines_and_soft_tokens() {
        let tokens = MediaTokens::new(&gemma3_caps(), text_of).unwrap();
        let text = "<start_of_turn>user\nlook<start_of_image>ok<end_of_turn>";
        let out = expand(text, None, &[item(MediaKind::Image, 3, 0.0)], &tokens).unwrap();
        assert_eq!(
            out,
            "<start_of_turn>user\nlook\n\n<start_of_image><image_soft_token><image_soft_token><image_soft_token><end_of_image>\n\nok<end_of_turn>"
        );
    }

    #[test]
    fn user_typed_markers_stay_text_and_counts_must_match() {
        let tokens = MediaTokens::new(&gemma4_caps(), text_of).unwrap();
        let mark = '\u{FDD0}';
        let text = format!("say {mark}<|image|> then <|image|> and <|audio|>");
        let items = [
            item(MediaKind::Image, 2, 0.0),
            item(MediaKind::Audio, 1, 1.0),
        ];
        let out = expand(&text, Some(mark), &items, &tokens).unwrap();
        assert_eq!(
            out,
            format!("say {mark}<|image|> then <|image><|image|><|image|><image|> and <|audio><|audio|><audio|>")
        );
        // One marker short, or the kinds swapped: 400s.
        assert!(expand("<|image|>", None, &items, &tokens).is_err());
        assert!(expand("<|audio|><|image|>", None, &items, &tokens).is_err());
        assert!(expand("<|image|><|image|><|audio|>", None, &items, &tokens).is_err());
    }

    #[test]
    fn qwen_pads_repeat_inside_the_templates_vision_tokens() {
        let caps = MediaCaps {
            vision: Some(VisionCaps {
                processor: VisionProcessor::Qwen {
                    patch: 16,
                    temporal_patch: 2,
                    merge: 2,
                    min_pixels: 65536,
                    max_pixels: 16777216,
                    mean: [0.5; 3],
                    std: [0.5; 3],
                },
                tokens_per_image: None,
                image_token_id: 30,
                boi_token_id: 31,
                eoi_token_id: 32,
            }),
            audio: None,
        };
        let text_of = |id: u32| {
            Some(
                match id {
                    30 => "<|image_pad|>",
                    31 => "<|vision_start|>",
                    32 => "<|vision_end|>",
                    _ => return None,
                }
                .to_string(),
            )
        };
        let tokens = MediaTokens::new(&caps, text_of).unwrap();
        let text = "look <|vision_start|><|image_pad|><|vision_end|> here";
        let out = expand(text, None, &[item(MediaKind::Image, 3, 0.0)], &tokens).unwrap();
        assert_eq!(
            out,
            "look <|vision_start|><|image_pad|><|image_pad|><|image_pad|><|vision_end|> here"
        );
    }

    #[test]
    fn spans_land_on_the_soft_token_runs() {
        let tokens = MediaTokens::new(&gemma4_caps(), text_of).unwrap();
        // bos, text, <|image>, 2 × image, <image|>, text, <|audio>, 3 × audio, <audio|>
        let ids = [2, 100, 11, 10, 10, 12, 101, 21, 20, 20, 20, 22];
        let items = vec![
            item(MediaKind::Image, 2, 0.5),
            item(MediaKind::Audio, 3, 0.25),
        ];
        let spans = spans(&ids, items, &tokens).unwrap();
        assert_eq!((spans[0].start, spans[0].len), (3, 2));
        assert_eq!((spans[1].start, spans[1].len), (8, 3));
        assert_ne!(spans[0].digest, spans[1].digest);
        // A run of the wrong length is refused.
        let short = vec![item(MediaKind::Image, 3, 0.5)];
        assert!(super::spans(&ids, short, &tokens).is_err());
    }
}
