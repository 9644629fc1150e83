//! Gemma 4's vision tower, as transformers' `Gemma4VisionModel` and `Gemma4MultimodalEmbedder`
//! compute it: the image is cut into patches (each `[row][column][channel]`, pixels mapped
//! from `[0, 1]` to `[-1, 1]`), embedded by one product plus learned x and y position rows,
//! run through bidirectional encoder layers (RMS sandwich norms, Q/K/V norms, axial rotary
//! embeddings: the first half of each head turns with the patch's column, the second half
//! with its row; attention scale 1; a gated tanh-GELU MLP), averaged over `pool × pool`
//! blocks of patches, scaled by `sqrt(hidden)`, optionally standardized, and projected into
//! the text model after an RMS norm without scale.
//!
//! An image of `w × h` patches gives `(w / pool) · (h / pool)` soft tokens, in row-major
//! block order. transformers pads every image to the processor's patch budget with patches
//! that no other patch attends to and that pool to nothing; the tower here reads only the
//! real patches, which is the same computation.
use std::borrow::Cow;

use serde_json::Value;
use wick_gguf::GgmlType;

use crate::backend::{Activation, AttentionParams, AttentionSegment, Backend, HostWeight};
use crate::config::media::Gemma4VisionConfig;
use crate::config::HfKeys;
use crate::media::{ImagePixels, VisionCaps, VisionProcessor};
use crate::models::decoder::loader::Loader;
use crate::weights::RAW_PREFIX;
use crate::{EngineError, Result};

/// Most encoder layers, width and position-table rows a config may declare (far above real
/// checkpoints; keeps a corrupt config from sizing huge buffers).
const MAX_LAYERS: usize = 256;
const MAX_WIDTH: usize = 1 << 16;
const MAX_POSITIONS: usize = 1 << 20;
/// transformers' `Gemma4ImageProcessor` default soft-token budget per image.
const DEFAULT_MAX_SOFT_TOKENS: usize = 280;
/// Largest soft-token budget read from a processor config (transformers allows up to 1120).
const MAX_SOFT_TOKENS: usize = 1 << 14;

fn config_error(source: &str, reason: String) -> EngineError {
    EngineError::Config {
        source_name: source.to_string(),
        reason,
    }
}

impl Gemma4VisionConfig {
    /// Reads a Gemma 4 `config.json`; `None` when it has no `vision_config`.
    pub(crate) fn from_hf(json: &Value, source: &str) -> Result<Option<Self>> {
        let Some(vision) = json.get("vision_config").filter(|v| v.is_object()) else {
            return Ok(None);
        };
        let keys = HfKeys {
            json: vision,
            source,
        };
        let top = HfKeys { json, source };
        let bounded = |key: &str, default: Option<usize>, max: usize| -> Result<usize> {
            let v = match default {
                Some(d) => keys.opt_usize(key)?.unwrap_or(d),
                None => keys.usize(key)?,
            };
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
        let hidden_size = bounded("hidden_size", None, MAX_WIDTH)?;
        let num_heads = bounded("num_attention_heads", None, MAX_WIDTH)?;
        let head_dim = match keys.opt_usize("head_dim")? {
            Some(d) => d,
            None => hidden_size / num_heads,
        };
        let theta = keys
            .get("rope_parameters")
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(100.0);
        if let Some(kind) = keys
            .get("rope_parameters")
            .and_then(|p| p.get("rope_type"))
            .and_then(Value::as_str)
        {
            if kind != "axial" {
                return Err(keys.bad("rope_parameters.rope_type", "must be 'axial'"));
            }
        }
        if let Some(act) = keys.get("hidden_activation").and_then(Value::as_str) {
            if !matches!(act, "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast") {
                return Err(keys.bad(
                    "hidden_activation",
                    "is not a tanh GELU (the one wick implements)",
                ));
            }
        }
        let cfg = Gemma4VisionConfig {
            hidden_size,
            intermediate_size: bounded("intermediate_size", None, 4 * MAX_WIDTH)?,
            num_layers: bounded("num_hidden_layers", None, MAX_LAYERS)?,
            num_heads,
            num_kv_heads: bounded("num_key_value_heads", Some(num_heads), MAX_WIDTH)?,
            head_dim,
            patch_size: bounded("patch_size", Some(16), 1 << 10)?,
            pool: bounded("pooling_kernel_size", Some(3), 64)?,
            position_rows: bounded("position_embedding_size", Some(10 * 1024), MAX_POSITIONS)?,
            rope_theta: theta,
            eps: keys.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            standardize: keys.opt_bool("standardize")?.unwrap_or(false),
            clipped_linears: keys.opt_bool("use_clipped_linears")?.unwrap_or(false),
            max_soft_tokens: DEFAULT_MAX_SOFT_TOKENS,
            image_token_id: id("image_token_id", 258_880)?,
            boi_token_id: id("boi_token_id", 255_999)?,
            eoi_token_id: id("eoi_token_id", 258_882)?,
        };
        let reason = if head_dim == 0 || !head_dim.is_multiple_of(4) || head_dim > MAX_WIDTH {
            Some(format!(
                "vision head_dim {head_dim} is not a positive multiple of 4 (two rotary axes)"
            ))
        } else if !num_heads.is_multiple_of(cfg.num_kv_heads) {
            Some(format!(
                "{num_heads} vision heads do not group over {} key/value heads",
                cfg.num_kv_heads
            ))
        } else if !(theta.is_finite() && theta > 0.0) {
            Some(format!("vision rope_theta {theta} is not positive"))
        } else {
            None
        };
        match reason {
            Some(reason) => Err(config_error(source, reason)),
            None => Ok(Some(cfg)),
        }
    }

    /// Takes the image budget from the image processor's config (`preprocessor_config.json`,
    /// or `processor_config.json`'s `image_processor`); transformers' default otherwise.
    pub(crate) fn read_processor(&mut self, json: &Value, source: &str) -> Result<()> {
        let fields = json.get("image_processor").unwrap_or(json);
        let Some(v) = fields.get("max_soft_tokens") else {
            return Ok(());
        };
        match v.as_u64() {
            Some(n) if (1..=MAX_SOFT_TOKENS as u64).contains(&n) => {
                self.max_soft_tokens = n as usize;
                Ok(())
            }
            _ => Err(config_error(
                source,
                format!("max_soft_tokens {v} is not in 1..={MAX_SOFT_TOKENS}"),
            )),
        }
    }

    /// What the server needs to prepare images and prompts for this tower.
    pub fn caps(&self) -> VisionCaps {
        VisionCaps {
            processor: VisionProcessor::Gemma4 {
                patch: self.patch_size,
                pool: self.pool,
                max_patches: self.max_soft_tokens * self.pool * self.pool,
            },
            tokens_per_image: None,
            image_token_id: self.image_token_id,
            boi_token_id: self.boi_token_id,
            eoi_token_id: self.eoi_token_id,
        }
    }

    /// Soft tokens of an image of `height × width` pixels, or why the tower cannot read it.
    pub fn soft_tokens(&self, channels: usize, height: usize, width: usize) -> Result<usize> {
        let side = self.patch_size * self.pool;
        let (pw, ph) = (width / self.patch_size, height / self.patch_size);
        if channels != 3
            || height == 0
            || width == 0
            || !height.is_multiple_of(side)
            || !width.is_multiple_of(side)
            || pw > self.position_rows
            || ph > self.position_rows
            || pw * ph > self.max_soft_tokens * self.pool * self.pool
        {
            return Err(EngineError::InvalidInput(format!(
                "the vision tower reads 3-channel images whose sides are multiples of {side} px \
                 within {} patches; the image is {channels}×{height}×{width}",
                self.max_soft_tokens * self.pool * self.pool
            )));
        }
        Ok(pw * ph / (self.pool * self.pool))
    }
}

/// A linear layer without bias, clamped on the way in and out when the checkpoint says so.
struct Clipped<B: Backend> {
    weight: B::Matrix,
    /// `[input_min, input_max, output_min, output_max]`.
    bounds: Option<[f32; 4]>,
}

impl<B: Backend> Clipped<B> {
    fn load(
        ld: &mut Loader<'_, B>,
        prefix: &str,
        rows: usize,
        cols: usize,
        clipped: bool,
    ) -> Result<Self> {
        let weight = ld.matrix(&format!("{prefix}.linear.weight"), rows, cols)?;
        let bounds = if clipped {
            let mut b = [0f32; 4];
            for (slot, key) in
                b.iter_mut()
                    .zip(["input_min", "input_max", "output_min", "output_max"])
            {
                let w = ld.required(&format!("{prefix}.{key}"))?;
                let n: usize = w.shape.iter().product();
                if n != 1 {
                    return Err(EngineError::ShapeMismatch {
                        source_name: ld.src.source_name(),
                        tensor: w.name.clone(),
                        expected: vec![],
                        found: w.shape.clone(),
                    });
                }
                *slot = w.float_values("clip bound")?[0];
            }
            Some(b)
        } else {
            None
        };
        Ok(Clipped { weight, bounds })
    }

    fn forward(&self, be: &B, x: &B::Tensor, rows: usize) -> Result<B::Tensor> {
        let Some([in_min, in_max, out_min, out_max]) = self.bounds else {
            return be.linear(x, &self.weight, None);
        };
        let x = clamp(be, x, rows, in_min, in_max)?;
        let y = be.linear(&x, &self.weight, None)?;
        clamp(be, &y, rows, out_min, out_max)
    }
}

/// `x` clamped to `[lo, hi]` (on the host; bounds may be infinite).
fn clamp<B: Backend>(be: &B, x: &B::Tensor, rows: usize, lo: f32, hi: f32) -> Result<B::Tensor> {
    let mut v = be.rows_to_host(x, &[rows])?.pop().unwrap_or_default();
    let cols = v.len() / rows.max(1);
    v.iter_mut().for_each(|x| *x = x.max(lo).min(hi));
    be.tensor_from_host(v, rows, cols)
}

/// One encoder layer.
struct EncoderLayer<B: Backend> {
    input_norm: B::Tensor,
    q: Clipped<B>,
    k: Clipped<B>,
    v: Clipped<B>,
    o: Clipped<B>,
    q_norm: B::Tensor,
    k_norm: B::Tensor,
    post_attn_norm: B::Tensor,
    pre_ffw_norm: B::Tensor,
    gate: Clipped<B>,
    up: Clipped<B>,
    down: Clipped<B>,
    post_ffw_norm: B::Tensor,
}

/// The Gemma 4 vision tower and its embedder into the text model, loaded.
pub(crate) struct Gemma4Vision<B: Backend> {
    cfg: Gemma4VisionConfig,
    text_hidden: usize,
    /// `[hidden, patch·patch·3]`.
    patch: B::Matrix,
    /// `[2][position_rows][hidden]`: x rows, then y rows.
    positions: Vec<f32>,
    layers: Vec<EncoderLayer<B>>,
    /// Ones: the V norm and the embedder's pre-projection norm have no scale.
    ones_head: B::Tensor,
    ones_hidden: B::Tensor,
    /// `(bias, scale)` of the standardization, when the tower has one.
    standardize: Option<(Vec<f32>, Vec<f32>)>,
    /// `[text_hidden, hidden]`.
    projection: B::Matrix,
}

fn name(s: &str) -> String {
    format!("{RAW_PREFIX}vision_tower.{s}")
}

fn ones<B: Backend>(be: &B, len: usize) -> Result<B::Tensor> {
    be.vector(HostWeight {
        name: "ones".into(),
        dtype: GgmlType::F32,
        shape: vec![len],
        bytes: Cow::Owned(1f32.to_le_bytes().repeat(len)),
    })
}

impl<B: Backend> Gemma4Vision<B> {
    /// Whether `ld`'s weights hold the tower and its embedder.
    pub(in crate::models) fn present(ld: &Loader<'_, B>) -> bool {
        ld.src.contains(&name("patch_embedder.input_proj.weight"))
            && ld.src.contains(&format!(
                "{RAW_PREFIX}embed_vision.embedding_projection.weight"
            ))
    }

    pub(in crate::models) fn load(
        ld: &mut Loader<'_, B>,
        cfg: &Gemma4VisionConfig,
        text_hidden: usize,
    ) -> Result<Self> {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let q_dim = cfg.num_heads * cfg.head_dim;
        let kv_dim = cfg.num_kv_heads * cfg.head_dim;
        let c = cfg.clipped_linears;
        let patch_in = 3 * cfg.patch_size * cfg.patch_size;
        let patch = ld.matrix(&name("patch_embedder.input_proj.weight"), d, patch_in)?;
        let table = ld.required(&name("patch_embedder.position_embedding_table"))?;
        ld.check(&table, &[2, cfg.position_rows, d])?;
        let positions = table.float_values("position table")?;
        ld.bytes += positions.len() * 4;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| name(&format!("encoder.layers.{i}.{s}"));
            layers.push(EncoderLayer {
                input_norm: ld.required_norm(&n("input_layernorm.weight"), d)?,
                q: Clipped::load(ld, &n("self_attn.q_proj"), q_dim, d, c)?,
                k: Clipped::load(ld, &n("self_attn.k_proj"), kv_dim, d, c)?,
                v: Clipped::load(ld, &n("self_attn.v_proj"), kv_dim, d, c)?,
                o: Clipped::load(ld, &n("self_attn.o_proj"), d, q_dim, c)?,
                q_norm: ld.required_norm(&n("self_attn.q_norm.weight"), cfg.head_dim)?,
                k_norm: ld.required_norm(&n("self_attn.k_norm.weight"), cfg.head_dim)?,
                post_attn_norm: ld.required_norm(&n("post_attention_layernorm.weight"), d)?,
                pre_ffw_norm: ld.required_norm(&n("pre_feedforward_layernorm.weight"), d)?,
                gate: Clipped::load(ld, &n("mlp.gate_proj"), f, d, c)?,
                up: Clipped::load(ld, &n("mlp.up_proj"), f, d, c)?,
                down: Clipped::load(ld, &n("mlp.down_proj"), d, f, c)?,
                post_ffw_norm: ld.required_norm(&n("post_feedforward_layernorm.weight"), d)?,
            });
        }
        let standardize = if cfg.standardize {
            let read = |ld: &Loader<'_, B>, s: &str| -> Result<Vec<f32>> {
                let w = ld.required(&name(s))?;
                ld.check(&w, &[d])?;
                w.float_values(s)
            };
            Some((read(ld, "std_bias")?, read(ld, "std_scale")?))
        } else {
            None
        };
        let projection = ld.matrix(
            &format!("{RAW_PREFIX}embed_vision.embedding_projection.weight"),
            text_hidden,
            d,
        )?;
        Ok(Gemma4Vision {
            cfg: cfg.clone(),
            text_hidden,
            patch,
            positions,
            layers,
            ones_head: ones(ld.backend, cfg.head_dim)?,
            ones_hidden: ones(ld.backend, d)?,
            standardize,
            projection,
        })
    }

    /// The image's soft-token rows in the text model's embedding space,
    /// `[soft tokens][text_hidden]` row-major.
    pub(crate) fn embed(&self, be: &B, image: &ImagePixels) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let tokens = cfg.soft_tokens(image.channels, image.height, image.width)?;
        if image.data.len() != 3 * image.height * image.width {
            return Err(EngineError::InvalidInput(format!(
                "an image of 3×{}×{} carries {} pixel values",
                image.height,
                image.width,
                image.data.len()
            )));
        }
        let (d, p) = (cfg.hidden_size, cfg.patch_size);
        let (pw, ph) = (image.width / p, image.height / p);
        let n = pw * ph;
        let mut x = be.linear(
            &be.tensor_from_host(patches(image, p), n, 3 * p * p)?,
            &self.patch,
            None,
        )?;
        x = be.add(&x, &be.tensor_from_host(self.position_rows(pw, ph), n, d)?)?;
        let rope = AxialRope::new(cfg, pw, ph);
        let params = AttentionParams {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            scale: 1.0,
            window: None,
            softcap: None,
        };
        // Every patch sees every patch.
        let ends = vec![n; n];
        let eps = cfg.eps;
        for l in &self.layers {
            let h = be.rms_norm(&x, &l.input_norm, eps)?;
            let q = be.rms_norm(&l.q.forward(be, &h, n)?, &l.q_norm, eps)?;
            let k = be.rms_norm(&l.k.forward(be, &h, n)?, &l.k_norm, eps)?;
            let v = be.rms_norm(&l.v.forward(be, &h, n)?, &self.ones_head, eps)?;
            let q = rope.apply(be, &q, n, cfg.num_heads)?;
            let k = rope.apply(be, &k, n, cfg.num_kv_heads)?;
            let mut scratch = be.new_kv_layer(cfg.num_kv_heads, cfg.head_dim, None);
            let mut segments = [AttentionSegment {
                rows: 0..n,
                cache: &mut scratch,
            }];
            let a = be.attention_to(&q, &k, &v, &mut segments, &params, &ends)?;
            let a = be.rms_norm(&l.o.forward(be, &a, n)?, &l.post_attn_norm, eps)?;
            x = be.add(&x, &a)?;
            let h = be.rms_norm(&x, &l.pre_ffw_norm, eps)?;
            let gate = l.gate.forward(be, &h, n)?;
            let up = l.up.forward(be, &h, n)?;
            let m = l
                .down
                .forward(be, &be.glu(&gate, &up, Activation::GeluTanh)?, n)?;
            x = be.add(&x, &be.rms_norm(&m, &l.post_ffw_norm, eps)?)?;
        }
        let encoded = be.rows_to_host(&x, &[n])?.pop().unwrap_or_default();
        let mut pooled = pool(&encoded, pw, ph, d, cfg.pool);
        let root = (d as f32).sqrt();
        pooled.iter_mut().for_each(|v| *v *= root);
        if let Some((bias, scale)) = &self.standardize {
            for row in pooled.chunks_exact_mut(d) {
                for ((v, b), s) in row.iter_mut().zip(bias).zip(scale) {
                    *v = (*v - b) * s;
                }
            }
        }
        let pooled = be.tensor_from_host(pooled, tokens, d)?;
        let normed = be.rms_norm(&pooled, &self.ones_hidden, eps)?;
        let out = be.linear(&normed, &self.projection, None)?;
        let rows = be.rows_to_host(&out, &[tokens])?.pop().unwrap_or_default();
        debug_assert_eq!(rows.len(), tokens * self.text_hidden);
        Ok(rows)
    }

    /// The x row plus the y row of each patch, patches in row-major order.
    fn position_rows(&self, pw: usize, ph: usize) -> Vec<f32> {
        let (d, rows) = (self.cfg.hidden_size, self.cfg.position_rows);
        let mut out = Vec::with_capacity(pw * ph * d);
        for y in 0..ph {
            for x in 0..pw {
                let xr = &self.positions[x * d..(x + 1) * d];
                let yr = &self.positions[(rows + y) * d..(rows + y + 1) * d];
                out.extend(xr.iter().zip(yr).map(|(a, b)| a + b));
            }
        }
        out
    }
}

/// The image's patches as rows `[patch][y][x][channel]`, patches in row-major grid order,
/// values mapped from `[0, 1]` to `[-1, 1]`.
fn patches(image: &ImagePixels, p: usize) -> Vec<f32> {
    let (h, w) = (image.height, image.width);
    let px = &image.data;
    let mut out = Vec::with_capacity(px.len());
    for gy in 0..h / p {
        for gx in 0..w / p {
            for y in gy * p..(gy + 1) * p {
                for x in gx * p..(gx + 1) * p {
                    for c in 0..3 {
                        out.push(2.0 * (px[c * h * w + y * w + x] - 0.5));
                    }
                }
            }
        }
    }
    out
}

/// Average of each `k × k` block of the `pw × ph` grid of `d`-wide rows, blocks row-major.
fn pool(encoded: &[f32], pw: usize, ph: usize, d: usize, k: usize) -> Vec<f32> {
    let (tw, th) = (pw / k, ph / k);
    let mut out = vec![0f32; tw * th * d];
    let scale = 1.0 / (k * k) as f32;
    for y in 0..ph {
        for x in 0..pw {
            let t = (y / k) * tw + x / k;
            let o = &mut out[t * d..(t + 1) * d];
            let r = &encoded[(y * pw + x) * d..(y * pw + x + 1) * d];
            // transformers weighs each patch by 1/k² before summing.
            o.iter_mut().zip(r).for_each(|(o, v)| *o += v * scale);
        }
    }
    out
}

/// The axial rotary angles of a patch grid: per patch, `cos`/`sin` of its column and of its
/// row times each of the `head_dim / 4` frequencies.
struct AxialRope {
    head_dim: usize,
    /// `[patch][axis][frequency]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl AxialRope {
    fn new(cfg: &Gemma4VisionConfig, pw: usize, ph: usize) -> Self {
        let half = cfg.head_dim / 2;
        let freqs = half / 2;
        let inv: Vec<f32> = (0..freqs)
            .map(|i| (1.0 / cfg.rope_theta.powf((2 * i) as f64 / half as f64)) as f32)
            .collect();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for y in 0..ph {
            for x in 0..pw {
                for pos in [x, y] {
                    for &f in &inv {
                        let a = pos as f32 * f;
                        cos.push(a.cos());
                        sin.push(a.sin());
                    }
                }
            }
        }
        AxialRope {
            head_dim: cfg.head_dim,
            cos,
            sin,
        }
    }

    /// `t` `[n, heads·head_dim]` with each head's first half rotated by the column angles
    /// and its second half by the row angles (each half as rotate-half pairs).
    fn apply<B: Backend>(
        &self,
        be: &B,
        t: &B::Tensor,
        n: usize,
        heads: usize,
    ) -> Result<B::Tensor> {
        let mut v = be.rows_to_host(t, &[n])?.pop().unwrap_or_default();
        let hd = self.head_dim;
        let (half, freqs) = (hd / 2, hd / 4);
        for (r, row) in v.chunks_exact_mut(heads * hd).enumerate() {
            for head in row.chunks_exact_mut(hd) {
                for (axis, part) in head.chunks_exact_mut(half).enumerate() {
                    let at = (r * 2 + axis) * freqs;
                    let (cos, sin) = (&self.cos[at..at + freqs], &self.sin[at..at + freqs]);
                    for i in 0..freqs {
                        let (a, b) = (part[i], part[i + freqs]);
                        part[i] = a * cos[i] - b * sin[i];
                        part[i + freqs] = b * cos[i] + a * sin[i];
                    }
                }
            }
        }
        be.tensor_from_host(v, n, heads * hd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_averages_row_major_blocks() {
        // A 6×3 grid of 1-wide rows holding their index, pooled 3×3: two blocks.
        let encoded: Vec<f32> = (0..18).map(|v| v as f32).collect();
        let out = pool(&encoded, 6, 3, 1, 3);
        let block = |xs: std::ops::Range<usize>| {
            (0..3)
                .flat_map(|y| xs.clone().map(move |x| (y * 6 + x) as f32))
                .sum::<f32>()
                / 9.0
        };
        assert_eq!(out.len(), 2);
        assert!((out[0] - block(0..3)).abs() < 1e-5);
        assert!((out[1] - block(3..6)).abs() < 1e-5);
    }
}
