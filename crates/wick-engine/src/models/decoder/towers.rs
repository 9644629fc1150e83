//! [`Towers`]: the media towers a multimodal checkpoint brings (one vision tower — Gemma 3's
//! SigLIP, Gemma 4's, or Qwen-VL's — and Gemma 4's audio Conformer), loaded where the
//! backend runs them, and the one place that turns a request's media into the rows a
//! sequence's cache keeps.
use super::loader::Loader;
use crate::backend::capability::{Capability, Need, Part, Support};
use crate::backend::Backend;
use crate::config::media::{AudioConfig, Gemma4VisionConfig, QwenTower, VisionConfig};
use crate::config::ModelConfig;
use crate::media::{AudioCaps, MediaData, MediaSpan, VisionCaps};
use crate::models::audio::gemma4::Gemma4Audio;
use crate::models::vision::gemma4::Gemma4Vision;
use crate::models::vision::qwen::QwenVision;
use crate::models::vision::siglip::Gemma3Vision;
use crate::models::vision::ImageRows;
use crate::{EngineError, Result};

/// What the towers `cfg` describes need of the backend.
pub(crate) fn needs(cfg: &ModelConfig) -> Vec<Need> {
    let mut needs = Vec::new();
    let mut vision = |c: Capability, why: &'static str| needs.push(Need::op(c, Part::Vision, why));
    if cfg.vision.is_some() {
        vision(Capability::LayerNorm, "SigLIP's LayerNorms");
        vision(Capability::Activation, "SigLIP's MLP");
        vision(
            Capability::AttentionTo,
            "an image's tokens seeing each other",
        );
        vision(Capability::HostTensors, "placing image rows in the prompt");
    }
    if cfg.gemma4.as_ref().is_some_and(|g| g.vision.is_some()) {
        vision(Capability::AttentionTo, "the vision encoder's attention");
        vision(Capability::HostTensors, "placing image rows in the prompt");
    }
    if let Some(q) = &cfg.qwen_vision {
        if q.tower == QwenTower::Qwen35 {
            vision(Capability::LayerNorm, "the vision tower's LayerNorms");
            vision(Capability::Activation, "the vision tower's GELU MLP");
        }
        vision(Capability::AttentionTo, "the vision tower's attention");
        vision(Capability::RopeAxes, "M-RoPE positions of image tokens");
        vision(Capability::HostTensors, "placing image rows in the prompt");
    }
    if cfg.audio.is_some() {
        needs.push(Need::op(
            Capability::HostTensors,
            Part::Audio,
            "the audio tower (it runs on the host)",
        ));
    }
    needs
}

/// A loaded vision tower.
enum VisionTower<B: Backend> {
    /// Gemma 3's SigLIP: a fixed square image, its soft tokens seeing each other both ways.
    Siglip(Gemma3Vision<B>, VisionConfig),
    /// Gemma 4's encoder: each image at its own aspect ratio; both ways only when the
    /// configuration says so.
    Gemma4(Gemma4Vision<B>, Gemma4VisionConfig, bool),
    /// Qwen-VL's tower: merged patch grids, M-RoPE positions, causal text attention.
    Qwen(QwenVision<B>),
}

/// The media towers of a model.
pub(crate) struct Towers<B: Backend> {
    vision: Option<VisionTower<B>>,
    audio: Option<(Gemma4Audio, AudioConfig)>,
    /// Why a tower the configuration describes did not load: (vision, audio).
    absent: [Option<String>; 2],
}

impl<B: Backend> Towers<B> {
    /// Loads the towers `cfg` describes whose weights are present and whose needs the
    /// backend meets (`support`); the others are left out with a warning, and a request
    /// that brings their media is told why.
    pub(crate) fn load(
        ld: &mut Loader<'_, B>,
        cfg: &ModelConfig,
        support: &Support,
    ) -> Result<Self> {
        let mut absent = [None, None];
        let arch = cfg.arch;
        let backend = ld.backend.name();
        let mut refused = |slot: usize, why: String| {
            tracing::warn!(backend, "{why}: the model reads text only");
            absent[slot] = Some(why);
        };
        let vision_ok = match &support.vision {
            Some(Err(e)) => {
                refused(0, e.to_string());
                false
            }
            Some(Ok(())) => true,
            None => false,
        };
        let mut vision = None;
        if vision_ok {
            let missing = || format!("this {arch} model has no vision tower in its checkpoint");
            if let Some(v) = &cfg.vision {
                match Gemma3Vision::present(ld) {
                    true => {
                        vision = Some(VisionTower::Siglip(
                            Gemma3Vision::load(ld, v, cfg.hidden_size)?,
                            v.clone(),
                        ))
                    }
                    false => refused(0, missing()),
                }
            } else if let Some((v, g)) = cfg
                .gemma4
                .as_ref()
                .and_then(|g| g.vision.as_ref().map(|v| (v, g)))
            {
                match Gemma4Vision::present(ld) {
                    true => {
                        let tower = Gemma4Vision::load(ld, v, cfg.hidden_size)?;
                        vision = Some(VisionTower::Gemma4(
                            tower,
                            v.clone(),
                            g.bidirectional_vision,
                        ));
                    }
                    false => refused(0, missing()),
                }
            } else if let Some(v) = &cfg.qwen_vision {
                match QwenVision::present(ld) {
                    true => {
                        if v.out_hidden_size != cfg.hidden_size {
                            return Err(EngineError::Config {
                                source_name: ld.src.source_name(),
                                reason: format!(
                                    "the vision tower's out_hidden_size {} is not the text model's hidden size {}",
                                    v.out_hidden_size, cfg.hidden_size
                                ),
                            });
                        }
                        vision = Some(VisionTower::Qwen(QwenVision::load(ld, v)?));
                    }
                    false => refused(0, missing()),
                }
            }
        }
        let mut audio = None;
        match (&cfg.audio, &support.audio) {
            (Some(a), Some(Ok(()))) if Gemma4Audio::present(ld) => {
                audio = Some((Gemma4Audio::load(ld, a, cfg.hidden_size)?, a.clone()));
            }
            (Some(_), Some(Ok(()))) => refused(
                1,
                format!("this {arch} model has no audio tower in its checkpoint"),
            ),
            (Some(_), Some(Err(e))) => refused(1, e.to_string()),
            _ => {}
        }
        Ok(Towers {
            vision,
            audio,
            absent,
        })
    }

    /// What the vision tower reads, when one loaded.
    pub(crate) fn vision_caps(&self) -> Option<VisionCaps> {
        match self.vision.as_ref()? {
            VisionTower::Siglip(_, c) => Some(c.caps()),
            VisionTower::Gemma4(_, c, _) => Some(c.caps()),
            VisionTower::Qwen(q) => Some(q.config().caps()),
        }
    }

    /// What the audio tower reads, when one loaded.
    pub(crate) fn audio_caps(&self) -> Option<AudioCaps> {
        self.audio.as_ref().map(|(_, c)| c.caps())
    }

    /// Whether no tower loaded.
    pub(crate) fn is_empty(&self) -> bool {
        self.vision.is_none() && self.audio.is_none()
    }

    /// Whether the text model attends causally over image tokens (Qwen-VL), rather than
    /// letting an image's tokens see each other both ways.
    pub(crate) fn causal_images(&self) -> bool {
        matches!(self.vision, Some(VisionTower::Qwen(_)))
    }

    /// Runs each item of `spans` through its tower: the rows a sequence's cache keeps, in
    /// prompt order. Spans must be apart and as long as their tower's output.
    pub(crate) fn embed_media(
        &self,
        be: &B,
        cfg: &ModelConfig,
        spans: &[MediaSpan],
    ) -> Result<Vec<ImageRows>> {
        let mut out = Vec::with_capacity(spans.len());
        for span in spans {
            let rows = match &span.data {
                MediaData::Image(pixels) => self.embed_image(be, cfg, span, pixels)?,
                MediaData::Audio(clip) => {
                    let Some((tower, _)) = &self.audio else {
                        return Err(self.missing(cfg, 1, "audio"));
                    };
                    let tokens = crate::models::audio::soft_tokens(clip.frames);
                    if span.len != tokens {
                        return Err(EngineError::InvalidInput(format!(
                            "an audio span at position {} has {} soft tokens; its {} feature frames make {}",
                            span.start, span.len, clip.frames, tokens
                        )));
                    }
                    ImageRows {
                        positions: span.start..span.start + span.len,
                        rows: tower.embed(clip)?.into(),
                        // A clip's soft tokens attend causally, like text (as transformers' Gemma 4).
                        bidirectional: false,
                        grid: None,
                    }
                }
            };
            out.push(rows);
        }
        out.sort_by_key(|r| r.positions.start);
        if let Some(w) = out
            .windows(2)
            .find(|w| w[0].positions.end > w[1].positions.start)
        {
            return Err(EngineError::InvalidInput(format!(
                "media spans overlap at position {}",
                w[1].positions.start
            )));
        }
        Ok(out)
    }

    /// One image's rows, its span checked against what its tower makes of it.
    fn embed_image(
        &self,
        be: &B,
        cfg: &ModelConfig,
        span: &MediaSpan,
        pixels: &crate::media::ImagePixels,
    ) -> Result<ImageRows> {
        let Some(tower) = &self.vision else {
            return Err(self.missing(cfg, 0, "images"));
        };
        let wrong = |tokens: usize| {
            EngineError::InvalidInput(format!(
                "an image span at position {} has {} soft tokens; its {}×{} image makes {tokens}",
                span.start, span.len, pixels.width, pixels.height
            ))
        };
        let positions = span.start..span.start + span.len;
        Ok(match tower {
            VisionTower::Siglip(t, c) => {
                if span.len != c.tokens_per_image {
                    return Err(wrong(c.tokens_per_image));
                }
                ImageRows {
                    positions,
                    rows: t.embed(be, pixels)?.into(),
                    bidirectional: true,
                    grid: None,
                }
            }
            VisionTower::Gemma4(t, c, bidirectional) => {
                let tokens = c.soft_tokens(pixels.channels, pixels.height, pixels.width)?;
                if span.len != tokens {
                    return Err(wrong(tokens));
                }
                ImageRows {
                    positions,
                    rows: t.embed(be, pixels)?.into(),
                    bidirectional: *bidirectional,
                    grid: None,
                }
            }
            VisionTower::Qwen(t) => {
                let (rows, cols) = t.config().merged_grid(pixels.height, pixels.width)?;
                if span.len != rows * cols {
                    return Err(wrong(rows * cols));
                }
                let (values, grid) = t.embed(be, pixels)?;
                ImageRows {
                    positions,
                    rows: values.into(),
                    // Qwen's text model attends causally over an image's tokens.
                    bidirectional: false,
                    grid: Some(grid),
                }
            }
        })
    }

    /// The error for media of a kind (`slot` 0 images, 1 audio) no tower reads.
    fn missing(&self, cfg: &ModelConfig, slot: usize, what: &str) -> EngineError {
        EngineError::InvalidInput(match &self.absent[slot] {
            Some(why) => format!("{why}: it cannot read {what}"),
            None => format!(
                "this {} model has no {} tower: it cannot read {what}",
                cfg.arch,
                ["vision", "audio"][slot]
            ),
        })
    }
}
