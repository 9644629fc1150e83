//! Gemma 3's vision tower: a SigLIP encoder (patch embedding, learned positions,
//! bidirectional pre-norm layers, a final LayerNorm) and the projector that pools its patch
//! grid to the image's soft tokens and maps them into the text model's embedding space.
//!
//! It runs through the [`Backend`] ops the text model uses (products, LayerNorm, GELU, and
//! attention over a scratch KV layer in which every patch sees every other); the patch
//! unfolding and the average pooling are done on the host.
use std::borrow::Cow;

use wick_gguf::GgmlType;

use super::VisionConfig;
use crate::backend::{Activation, AttentionParams, AttentionSegment, Backend, HostWeight};
use crate::media::ImagePixels;
use crate::models::decoder::loader::Loader;
use crate::weights::RAW_PREFIX;
use crate::{EngineError, Result};

/// One encoder layer: LayerNorm → attention → residual, LayerNorm → MLP → residual.
struct EncoderLayer<B: Backend> {
    norm1: (B::Tensor, B::Tensor),
    q: (B::Matrix, B::Tensor),
    k: (B::Matrix, B::Tensor),
    v: (B::Matrix, B::Tensor),
    out: (B::Matrix, B::Tensor),
    norm2: (B::Tensor, B::Tensor),
    fc1: (B::Matrix, B::Tensor),
    fc2: (B::Matrix, B::Tensor),
}

/// The SigLIP encoder and Gemma 3's multimodal projector, loaded.
pub(crate) struct Gemma3Vision<B: Backend> {
    cfg: VisionConfig,
    text_hidden: usize,
    /// The patch convolution as a product over unfolded patches `[hidden, c·p·p]`.
    patch: (B::Matrix, B::Tensor),
    /// Learned position embeddings, one row per patch.
    positions: B::Tensor,
    layers: Vec<EncoderLayer<B>>,
    post_norm: (B::Tensor, B::Tensor),
    /// The projector's RMSNorm scale (stored as an offset from one; uploaded as 1 + w).
    soft_norm: B::Tensor,
    /// `mm_input_projection_weight` transposed: `[text_hidden, hidden]`.
    projection: B::Matrix,
}

fn name(s: &str) -> String {
    format!("{RAW_PREFIX}vision_tower.{s}")
}

impl<B: Backend> Gemma3Vision<B> {
    /// Whether `ld`'s weights hold the tower (a checkpoint may ship the text model only).
    pub(in crate::models) fn present(ld: &Loader<'_, B>) -> bool {
        ld.src.contains(&name("post_layernorm.weight"))
            && ld.src.contains(&format!(
                "{RAW_PREFIX}multi_modal_projector.mm_input_projection_weight"
            ))
    }

    pub(in crate::models) fn load(
        ld: &mut Loader<'_, B>,
        cfg: &VisionConfig,
        text_hidden: usize,
    ) -> Result<Self> {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let p = cfg.patch_size;
        let patch_in = cfg.channels * p * p;
        let linear = |ld: &mut Loader<'_, B>, n: &str, rows: usize, cols: usize| {
            Ok::<_, EngineError>((
                ld.matrix(&name(&format!("{n}.weight")), rows, cols)?,
                ld.required_vector(&name(&format!("{n}.bias")), rows)?,
            ))
        };
        let layer_norm = |ld: &mut Loader<'_, B>, n: &str| {
            Ok::<_, EngineError>((
                ld.required_vector(&name(&format!("{n}.weight")), d)?,
                ld.required_vector(&name(&format!("{n}.bias")), d)?,
            ))
        };
        // The convolution's kernel `[hidden, c, p, p]` is the matrix `[hidden, c·p·p]`.
        let conv = ld.required(&name("embeddings.patch_embedding.weight"))?;
        ld.check(&conv, &[d, cfg.channels, p, p])?;
        let conv = HostWeight {
            shape: vec![d, patch_in],
            ..conv
        };
        let patch_matrix = ld.backend.matrix(conv)?;
        let patch = (
            patch_matrix,
            ld.required_vector(&name("embeddings.patch_embedding.bias"), d)?,
        );
        let patches = cfg.patches_per_side() * cfg.patches_per_side();
        let pos = ld.required(&name("embeddings.position_embedding.weight"))?;
        ld.check(&pos, &[patches, d])?;
        let positions =
            ld.backend
                .tensor_from_host(pos.float_values("position embedding")?, patches, d)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("encoder.layers.{i}.{s}");
            layers.push(EncoderLayer {
                norm1: layer_norm(ld, &n("layer_norm1"))?,
                q: linear(ld, &n("self_attn.q_proj"), d, d)?,
                k: linear(ld, &n("self_attn.k_proj"), d, d)?,
                v: linear(ld, &n("self_attn.v_proj"), d, d)?,
                out: linear(ld, &n("self_attn.out_proj"), d, d)?,
                norm2: layer_norm(ld, &n("layer_norm2"))?,
                fc1: linear(ld, &n("mlp.fc1"), f, d)?,
                fc2: linear(ld, &n("mlp.fc2"), d, f)?,
            });
        }
        let post_norm = layer_norm(ld, "post_layernorm")?;
        let proj_name = format!("{RAW_PREFIX}multi_modal_projector.mm_input_projection_weight");
        let soft_norm = ld.required_norm(
            &format!("{RAW_PREFIX}multi_modal_projector.mm_soft_emb_norm.weight"),
            d,
        )?;
        let w = ld.required(&proj_name)?;
        ld.check(&w, &[d, text_hidden])?;
        // Stored `[in, out]` (the projector multiplies by it from the right).
        let values = w.float_values("projection")?;
        let mut transposed = vec![0f32; values.len()];
        for (r, row) in values.chunks_exact(text_hidden).enumerate() {
            for (c, &v) in row.iter().enumerate() {
                transposed[c * d + r] = v;
            }
        }
        let projection = ld.backend.matrix(HostWeight {
            name: w.name,
            dtype: GgmlType::F32,
            shape: vec![text_hidden, d],
            bytes: Cow::Owned(transposed.iter().flat_map(|v| v.to_le_bytes()).collect()),
        })?;
        ld.bytes += (patches + patch_in + text_hidden) * d * 4;
        Ok(Gemma3Vision {
            cfg: cfg.clone(),
            text_hidden,
            patch,
            positions,
            layers,
            post_norm,
            soft_norm,
            projection,
        })
    }

    /// The image's soft-token rows in the text model's embedding space,
    /// `[tokens_per_image][text_hidden]` row-major.
    pub(crate) fn embed(&self, be: &B, image: &ImagePixels) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let size = cfg.image_size;
        if image.channels != cfg.channels
            || image.height != size
            || image.width != size
            || image.data.len() != cfg.channels * size * size
        {
            return Err(EngineError::InvalidInput(format!(
                "the vision tower reads {}×{size}×{size} pixel values; the image has {}×{}×{} ({} values)",
                cfg.channels,
                image.channels,
                image.height,
                image.width,
                image.data.len()
            )));
        }
        let d = cfg.hidden_size;
        let side = cfg.patches_per_side();
        let n = side * side;
        let mut x = be.linear(
            &be.tensor_from_host(
                unfold(cfg, &image.data),
                n,
                cfg.channels * cfg.patch_size.pow(2),
            )?,
            &self.patch.0,
            Some(&self.patch.1),
        )?;
        x = be.add(&x, &self.positions)?;
        let heads = cfg.num_heads;
        let params = AttentionParams {
            heads,
            kv_heads: heads,
            head_dim: d / heads,
            scale: 1.0 / ((d / heads) as f32).sqrt(),
            window: None,
            softcap: None,
        };
        // Every patch sees every patch.
        let ends = vec![n; n];
        for l in &self.layers {
            let h = be.layer_norm(&x, &l.norm1.0, Some(&l.norm1.1), cfg.eps)?;
            let qkv = be.linear_many(
                &h,
                &[
                    (&l.q.0, Some(&l.q.1)),
                    (&l.k.0, Some(&l.k.1)),
                    (&l.v.0, Some(&l.v.1)),
                ],
            )?;
            let [q, k, v] = <[B::Tensor; 3]>::try_from(qkv).map_err(|_| {
                EngineError::InvalidInput("backend returned the wrong number of products".into())
            })?;
            let mut scratch = be.new_kv_layer(heads, d / heads, None);
            let mut segments = [AttentionSegment {
                rows: 0..n,
                cache: &mut scratch,
            }];
            let a = be.attention_to(&q, &k, &v, &mut segments, &params, &ends)?;
            x = be.add(&x, &be.linear(&a, &l.out.0, Some(&l.out.1))?)?;
            let h = be.layer_norm(&x, &l.norm2.0, Some(&l.norm2.1), cfg.eps)?;
            let m = be.activation(
                &be.linear(&h, &l.fc1.0, Some(&l.fc1.1))?,
                Activation::GeluTanh,
            )?;
            x = be.add(&x, &be.linear(&m, &l.fc2.0, Some(&l.fc2.1))?)?;
        }
        x = be.layer_norm(&x, &self.post_norm.0, Some(&self.post_norm.1), cfg.eps)?;
        let encoded = be.rows_to_host(&x, &[n])?.pop().unwrap_or_default();
        let tokens = cfg.tokens_per_image;
        let pooled = pool(&encoded, side, d, tokens);
        let pooled = be.tensor_from_host(pooled, tokens, d)?;
        let normed = be.rms_norm(&pooled, &self.soft_norm, cfg.eps)?;
        let out = be.linear(&normed, &self.projection, None)?;
        let rows = be.rows_to_host(&out, &[tokens])?.pop().unwrap_or_default();
        debug_assert_eq!(rows.len(), tokens * self.text_hidden);
        Ok(rows)
    }
}

/// The image's patches as rows `[patch][channel][y][x]`, patches in row-major grid order
/// (the convolution's output order).
fn unfold(cfg: &VisionConfig, pixels: &[f32]) -> Vec<f32> {
    let (p, size, side) = (cfg.patch_size, cfg.image_size, cfg.patches_per_side());
    let mut out = Vec::with_capacity(pixels.len());
    for py in 0..side {
        for px in 0..side {
            for c in 0..cfg.channels {
                for y in 0..p {
                    let row = c * size * size + (py * p + y) * size + px * p;
                    out.extend_from_slice(&pixels[row..row + p]);
                }
            }
        }
    }
    out
}

/// Average pooling of the `side × side` grid of `d`-wide rows to `tokens` rows (a square
/// grid whose side divides `side`).
fn pool(encoded: &[f32], side: usize, d: usize, tokens: usize) -> Vec<f32> {
    let t_side = (tokens as f64).sqrt() as usize;
    let k = side / t_side;
    let mut out = vec![0f32; tokens * d];
    let scale = 1.0 / (k * k) as f32;
    for ty in 0..t_side {
        for tx in 0..t_side {
            let o = &mut out[(ty * t_side + tx) * d..(ty * t_side + tx + 1) * d];
            for y in ty * k..(ty + 1) * k {
                for x in tx * k..(tx + 1) * k {
                    let r = &encoded[(y * side + x) * d..(y * side + x + 1) * d];
                    o.iter_mut().zip(r).for_each(|(o, v)| *o += v);
                }
            }
            o.iter_mut().for_each(|v| *v *= scale);
        }
    }
    out
}
