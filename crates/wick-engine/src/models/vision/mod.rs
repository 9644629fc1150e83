//! Vision towers: what turns an image's pixels into rows of the text model's embedding
//! space, and how those rows enter a forward pass.
//!
//! - this file: the tower's configuration, the projected rows a sequence keeps
//!   ([`ImageRows`]), and the rule that places them in a pass ([`PassMedia`]);
//! - `siglip.rs`: Gemma 3's SigLIP encoder and its pooling projector;
//! - `gemma4.rs`: Gemma 4's encoder (2-D positions, axial rotary embeddings, 3×3 pooling)
//!   and its embedder, whose rows [`crate::models::gemma4`] places.
//! - `qwen.rs`: Qwen 3.5's tower (3-D patch embedding, 2-D rotary, 2×2 patch merger).
//!
//! A request's images run through the tower once, when the request's cache is set up
//! ([`crate::Model::attach_media`]); the cache keeps the rows. A prefill pass that reaches
//! an image's soft tokens takes its rows instead of the token embeddings, and the soft
//! tokens of one image attend to each other both ways (everything else stays causal).
pub mod gemma4;
pub mod qwen;
pub(crate) mod siglip;

use std::ops::Range;
use std::sync::Arc;

use serde_json::Value;

use crate::config::media::VisionConfig;
use crate::config::HfKeys;
use crate::media::{VisionCaps, VisionProcessor};
use crate::{EngineError, Result};

/// Most encoder layers, width and patches a vision tower may declare (far above real
/// checkpoints; keeps a corrupt config from sizing huge buffers).
const MAX_LAYERS: usize = 256;
const MAX_WIDTH: usize = 1 << 16;
const MAX_PATCHES: usize = 1 << 16;

impl VisionConfig {
    /// Reads a Gemma 3 `config.json`; `None` when it has no `vision_config` (a text-only
    /// checkpoint).
    pub(crate) fn from_hf(json: &Value, source: &str) -> Result<Option<Self>> {
        let Some(vision) = json.get("vision_config").filter(|v| v.is_object()) else {
            return Ok(None);
        };
        let keys = HfKeys {
            json: vision,
            source,
        };
        let top = HfKeys { json, source };
        let bounded = |key: &str, max: usize| -> Result<usize> {
            let v = keys.usize(key)?;
            if v == 0 || v > max {
                return Err(keys.bad(key, &format!("must be in 1..={max}")));
            }
            Ok(v)
        };
        let id = |key: &str, default: u32| -> Result<u32> {
            top.opt_usize(key)?.map_or(Ok(default), |v| {
                u32::try_from(v).map_err(|_| top.bad(key, "is not a token id"))
            })
        };
        let cfg = VisionConfig {
            hidden_size: bounded("hidden_size", MAX_WIDTH)?,
            intermediate_size: bounded("intermediate_size", 4 * MAX_WIDTH)?,
            num_layers: bounded("num_hidden_layers", MAX_LAYERS)?,
            num_heads: bounded("num_attention_heads", MAX_WIDTH)?,
            channels: keys.opt_usize("num_channels")?.unwrap_or(3),
            image_size: bounded("image_size", MAX_WIDTH)?,
            patch_size: bounded("patch_size", MAX_WIDTH)?,
            eps: keys.opt_f64("layer_norm_eps")?.unwrap_or(1e-6) as f32,
            tokens_per_image: top.opt_usize("mm_tokens_per_image")?.unwrap_or(256),
            image_token_id: id("image_token_index", 262_144)?,
            boi_token_id: id("boi_token_index", 255_999)?,
            eoi_token_id: id("eoi_token_index", 256_000)?,
        };
        if let Some(act) = keys.get("hidden_act").and_then(Value::as_str) {
            if !matches!(act, "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast") {
                return Err(keys.bad("hidden_act", "is not a tanh GELU (the one wick implements)"));
            }
        }
        cfg.check(source)?;
        Ok(Some(cfg))
    }

    fn check(&self, source: &str) -> Result<()> {
        let side = self.patches_per_side();
        let tokens_side = (self.tokens_per_image as f64).sqrt() as usize;
        let reason = if !self.hidden_size.is_multiple_of(self.num_heads) {
            Some(format!(
                "vision hidden_size {} is not a multiple of its {} heads",
                self.hidden_size, self.num_heads
            ))
        } else if !self.image_size.is_multiple_of(self.patch_size) || side * side > MAX_PATCHES {
            Some(format!(
                "image_size {} is not a whole number of {}-pixel patches (or too many)",
                self.image_size, self.patch_size
            ))
        } else if tokens_side == 0
            || tokens_side * tokens_side != self.tokens_per_image
            || !side.is_multiple_of(tokens_side)
        {
            Some(format!(
                "mm_tokens_per_image {} is not a square that divides the {side}×{side} patch grid",
                self.tokens_per_image
            ))
        } else {
            None
        };
        match reason {
            Some(reason) => Err(EngineError::Config {
                source_name: source.to_string(),
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Patches along each side of the image.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// What the server needs to prepare images and prompts for this tower.
    pub fn caps(&self) -> VisionCaps {
        VisionCaps {
            processor: VisionProcessor::Gemma3 {
                size: self.image_size,
            },
            tokens_per_image: Some(self.tokens_per_image),
            image_token_id: self.image_token_id,
            boi_token_id: self.boi_token_id,
            eoi_token_id: self.eoi_token_id,
        }
    }
}

/// One media item's projected rows (an image's, or an audio clip's on models whose audio
/// tower feeds the same pass), kept with the sequence's cache until a pass places them.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageRows {
    /// Prompt positions the rows replace.
    pub positions: Range<usize>,
    /// `positions.len() × hidden` values, row-major.
    pub rows: Arc<[f32]>,
    /// The item's soft tokens see each other both ways (Gemma 3's images; Gemma 4's with
    /// `use_bidirectional_attention: "vision"`, on its sliding layers); otherwise causal.
    pub bidirectional: bool,
    /// The soft tokens' grid `(rows, columns)` for towers whose text model places them in
    /// 2-D (Qwen's M-RoPE, [`crate::models::mrope`]); `None` otherwise.
    pub grid: Option<(usize, usize)>,
}

/// Where a forward pass meets images: rows to overwrite and how far each row sees.
pub(crate) struct PassMedia {
    /// `(row of the flattened pass, the image row's values)`.
    pub replace: Vec<(usize, Arc<[f32]>, usize)>,
    /// For every row of the pass, the end (exclusive) of the key positions it sees: its
    /// own position + 1, or the end of its item for a soft token of a bidirectional item.
    pub ends: Vec<usize>,
}

impl PassMedia {
    /// The images of each item that fall in this pass: `images[i]` of the item whose new
    /// positions are `passes[i]` and whose rows are `rows[i]` of the flattened pass.
    /// `None` when no image falls in the pass; an error when the pass starts or ends inside
    /// an image (its soft tokens must be in one pass to see each other).
    pub fn for_pass(
        images: &[&[ImageRows]],
        passes: &[Range<usize>],
        rows: &[Range<usize>],
    ) -> Result<Option<PassMedia>> {
        let mut out: Option<PassMedia> = None;
        for ((imgs, pass), flat) in images.iter().zip(passes).zip(rows) {
            for img in imgs.iter() {
                let p = &img.positions;
                if p.end <= pass.start || p.start >= pass.end {
                    continue;
                }
                if p.start < pass.start || p.end > pass.end {
                    return Err(EngineError::InvalidInput(format!(
                        "a forward pass over positions {}..{} cuts the image at {}..{}",
                        pass.start, pass.end, p.start, p.end
                    )));
                }
                let m = out.get_or_insert_with(|| PassMedia {
                    replace: Vec::new(),
                    ends: Vec::new(),
                });
                let first = flat.start + (p.start - pass.start);
                for i in 0..p.len() {
                    m.replace.push((first + i, img.rows.clone(), i));
                }
            }
        }
        let Some(mut m) = out else {
            return Ok(None);
        };
        for (pass, flat) in passes.iter().zip(rows) {
            m.ends.extend((pass.start..pass.end).map(|p| p + 1));
            debug_assert_eq!(m.ends.len(), flat.end);
        }
        for (imgs, (pass, flat)) in images.iter().zip(passes.iter().zip(rows)) {
            for img in imgs.iter().filter(|img| img.bidirectional) {
                let p = &img.positions;
                if p.start >= pass.start && p.end <= pass.end {
                    let first = flat.start + (p.start - pass.start);
                    m.ends[first..first + p.len()].fill(p.end);
                }
            }
        }
        Ok(Some(m))
    }
}

/// The largest prefill chunk end in `from + 1 ..= to` that cuts no image of `images`
/// (positions `from .. end` then hold whole images only); when every end in that range
/// cuts one, the end of the image that `from` starts, so that the image goes in one pass.
pub fn chunk_end(images: &[ImageRows], from: usize, to: usize) -> usize {
    let mut end = to;
    for img in images {
        let p = &img.positions;
        if p.start < end && end < p.end {
            end = p.start;
        }
    }
    if end > from {
        return end;
    }
    // The chunk starts at an image longer than the chunk: take the whole image.
    images
        .iter()
        .find(|img| img.positions.start == from)
        .map_or(to, |img| img.positions.end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(positions: Range<usize>) -> ImageRows {
        ImageRows {
            rows: vec![0.0; positions.len()].into(),
            positions,
            bidirectional: true,
            grid: None,
        }
    }

    #[test]
    fn chunks_never_cut_an_image() {
        let imgs = [image(4..8), image(10..20)];
        assert_eq!(chunk_end(&imgs, 0, 6), 4);
        assert_eq!(chunk_end(&imgs, 4, 6), 8);
        assert_eq!(chunk_end(&imgs, 4, 9), 9);
        assert_eq!(chunk_end(&imgs, 8, 12), 10);
        assert_eq!(chunk_end(&imgs, 10, 12), 20);
        assert_eq!(chunk_end(&imgs, 20, 30), 30);
    }

    #[test]
    fn a_pass_that_cuts_an_image_is_refused() {
        let imgs = [image(4..8)];
        let pass = |p: Range<usize>, flat: Range<usize>| {
            PassMedia::for_pass(
                &[&imgs],
                std::slice::from_ref(&p),
                std::slice::from_ref(&flat),
            )
        };
        assert!(pass(2..6, 0..4).is_err());
        let m = pass(2..10, 0..8).unwrap().unwrap();
        assert_eq!(m.ends, vec![3, 4, 8, 8, 8, 8, 9, 10]);
        assert_eq!(m.replace.len(), 4);
        assert!(pass(8..10, 0..2).unwrap().is_none());
    }

    #[test]
    fn causal_items_are_placed_but_see_only_backwards() {
        let imgs = [ImageRows {
            bidirectional: false,
            ..image(4..8)
        }];
        let (pass, flat) = (2..10, 0..8);
        let m = PassMedia::for_pass(
            &[&imgs],
            std::slice::from_ref(&pass),
            std::slice::from_ref(&flat),
        )
        .unwrap()
        .unwrap();
        assert_eq!(m.ends, vec![3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(m.replace.len(), 4);
    }
}
