//! Qwen 3.5's vision tower: a patch embedding over `temporal × p × p` cubes (a still image
//! repeats its frame), learned positions interpolated to the image's patch grid, pre-norm
//! blocks whose attention turns queries and keys with a 2-D (row, column) rotary and sees
//! the whole image, and the merger that joins each `merge × merge` window of patches into
//! one row of the text model's width.
//!
//! Patches run in merge-window order (window row, window column, row and column inside the
//! window), as transformers' processor emits them, so that each window's patches are
//! consecutive rows for the merger. The input is the processed image `[c, h, w]`; the
//! unfolding into patches, the position interpolation and the merger's exact GELU are done
//! on the host, the rest through the [`Backend`] ops the text model uses.
use serde_json::Value;

use crate::backend::{
    Activation, AttentionParams, AttentionSegment, Backend, HostWeight, OptionalOp, RopeSpec,
    RopeStyle,
};
use crate::config::HfKeys;
use crate::media::{ImagePixels, VisionCaps, VisionProcessor};
use crate::models::decoder::Loader;
use crate::weights::RAW_PREFIX;
use crate::{EngineError, Result};

/// Most blocks, width and learned positions a Qwen vision config may declare (far above
/// real checkpoints; keeps a corrupt config from sizing huge buffers).
const MAX_DEPTH: usize = 256;
const MAX_WIDTH: usize = 1 << 16;
const MAX_POSITIONS: usize = 1 << 20;
/// Most patches one image may bring (a 16 Mpx image in 16-pixel patches; the processor's
/// pixel budget keeps real requests far below).
const MAX_PATCHES: usize = 1 << 16;

/// Qwen 3.5's vision tower, from `config.json`'s `vision_config`, the token ids beside it and
/// the image processor's `preprocessor_config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenVisionConfig {
    /// Blocks.
    pub depth: usize,
    /// Width of the blocks.
    pub hidden_size: usize,
    /// Inner width of the blocks' MLP.
    pub intermediate_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Input channels (3).
    pub channels: usize,
    /// Side of a patch, in pixels.
    pub patch_size: usize,
    /// Frames per patch cube (a still image repeats its frame this many times).
    pub temporal_patch_size: usize,
    /// Patches per side of the window the merger joins into one soft token.
    pub merge_size: usize,
    /// Width of the merger's output (the text model's hidden size).
    pub out_hidden_size: usize,
    /// Learned positions (a square grid).
    pub num_position_embeddings: usize,
    /// Base of the blocks' 2-D rotary.
    pub rope_theta: f64,
    /// The soft token an image's rows stand for.
    pub image_token_id: u32,
    /// `<|vision_start|>`.
    pub vision_start_token_id: u32,
    /// `<|vision_end|>`.
    pub vision_end_token_id: u32,
    /// The processor's pixel budget: fewest pixels after resizing.
    pub min_pixels: usize,
    /// Most pixels after resizing.
    pub max_pixels: usize,
    /// Per-channel mean subtracted after rescaling to `[0, 1]`.
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation divided by.
    pub image_std: [f32; 3],
}

impl QwenVisionConfig {
    /// Reads a Qwen 3.5 `config.json`; `None` when it has no `vision_config` (a text-only
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
        if let Some(act) = keys.get("hidden_act").and_then(Value::as_str) {
            if !matches!(act, "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast") {
                return Err(keys.bad("hidden_act", "is not a tanh GELU (the one wick implements)"));
            }
        }
        let rope_theta = vision
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0);
        let cfg = QwenVisionConfig {
            depth: bounded("depth", None, MAX_DEPTH)?,
            hidden_size: bounded("hidden_size", None, MAX_WIDTH)?,
            intermediate_size: bounded("intermediate_size", None, 4 * MAX_WIDTH)?,
            num_heads: bounded("num_heads", None, MAX_WIDTH)?,
            channels: bounded("in_channels", Some(3), 4)?,
            patch_size: bounded("patch_size", Some(16), 1024)?,
            temporal_patch_size: bounded("temporal_patch_size", Some(2), 16)?,
            merge_size: bounded("spatial_merge_size", Some(2), 16)?,
            out_hidden_size: bounded("out_hidden_size", None, MAX_WIDTH)?,
            num_position_embeddings: bounded("num_position_embeddings", None, MAX_POSITIONS)?,
            rope_theta,
            image_token_id: id("image_token_id", 248_056)?,
            vision_start_token_id: id("vision_start_token_id", 248_053)?,
            vision_end_token_id: id("vision_end_token_id", 248_054)?,
            // Qwen 3.5's processor defaults (Qwen3-VL's): 64 Ki to 16 Mi pixels, mean/std 0.5.
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
        };
        cfg.check(source)?;
        Ok(Some(cfg))
    }

    /// Takes the pixel budget and normalisation from the directory's
    /// `preprocessor_config.json` (`size.shortest_edge` / `size.longest_edge` or
    /// `min_pixels` / `max_pixels`, `image_mean`, `image_std`).
    pub(crate) fn with_preprocessor(mut self, json: &Value, source: &str) -> Result<Self> {
        let keys = HfKeys { json, source };
        let size = json.get("size");
        let pixels = |edge: &str, flat: &str| -> Result<Option<usize>> {
            match size.and_then(|s| s.get(edge)).and_then(Value::as_u64) {
                Some(v) => Ok(Some(v as usize)),
                None => keys.opt_usize(flat),
            }
        };
        if let Some(v) = pixels("shortest_edge", "min_pixels")? {
            self.min_pixels = v;
        }
        if let Some(v) = pixels("longest_edge", "max_pixels")? {
            self.max_pixels = v;
        }
        let triple = |key: &str| -> Result<Option<[f32; 3]>> {
            let Some(v) = json.get(key) else {
                return Ok(None);
            };
            let vals: Vec<f32> = v
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_f64)
                        .map(|x| x as f32)
                        .collect()
                })
                .unwrap_or_default();
            <[f32; 3]>::try_from(vals)
                .map(Some)
                .map_err(|_| keys.bad(key, "must be three numbers"))
        };
        if let Some(m) = triple("image_mean")? {
            self.image_mean = m;
        }
        if let Some(s) = triple("image_std")? {
            if s.iter().any(|&v| v <= 0.0) {
                return Err(keys.bad("image_std", "must be positive"));
            }
            self.image_std = s;
        }
        for (key, v) in [
            ("patch_size", self.patch_size),
            ("merge_size", self.merge_size),
            ("temporal_patch_size", self.temporal_patch_size),
        ] {
            if keys.opt_usize(key)?.is_some_and(|p| p != v) {
                return Err(keys.bad(key, &format!("differs from the vision tower's {v}")));
            }
        }
        if self.min_pixels > self.max_pixels
            || self.max_pixels > MAX_PATCHES * self.patch_size.pow(2)
        {
            return Err(keys.bad(
                "size",
                &format!(
                    "pixel budget {}..={} is empty or above {MAX_PATCHES} patches",
                    self.min_pixels, self.max_pixels
                ),
            ));
        }
        Ok(self)
    }

    fn check(&self, source: &str) -> Result<()> {
        let side = self.grid_side();
        let head_dim = self.hidden_size / self.num_heads.max(1);
        let reason = if !self.hidden_size.is_multiple_of(self.num_heads) || head_dim % 4 != 0 {
            Some(format!(
                "vision hidden_size {} over {} heads is not a head width divisible by 4 (the 2-D rotary needs it)",
                self.hidden_size, self.num_heads
            ))
        } else if side * side != self.num_position_embeddings {
            Some(format!(
                "num_position_embeddings {} is not a square grid",
                self.num_position_embeddings
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

    /// Side of the learned position grid.
    fn grid_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }

    /// What the server needs to prepare images and prompts for this tower.
    pub fn caps(&self) -> VisionCaps {
        VisionCaps {
            processor: VisionProcessor::Qwen {
                patch: self.patch_size,
                temporal_patch: self.temporal_patch_size,
                merge: self.merge_size,
                min_pixels: self.min_pixels,
                max_pixels: self.max_pixels,
                mean: self.image_mean,
                std: self.image_std,
            },
            tokens_per_image: None,
            image_token_id: self.image_token_id,
            boi_token_id: self.vision_start_token_id,
            eoi_token_id: self.vision_end_token_id,
        }
    }

    /// The merged grid `(rows, columns)` of an image of `height × width` pixels: one soft
    /// token per cell. An error unless both sides are whole windows of patches.
    pub fn merged_grid(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let side = self.patch_size * self.merge_size;
        if height == 0
            || width == 0
            || !height.is_multiple_of(side)
            || !width.is_multiple_of(side)
            || (height / self.patch_size) * (width / self.patch_size) > MAX_PATCHES
        {
            return Err(EngineError::InvalidInput(format!(
                "the vision tower reads images whose sides are multiples of {side} px (at most {MAX_PATCHES} patches); this one is {width}×{height}"
            )));
        }
        Ok((height / side, width / side))
    }
}

/// One block: LayerNorm → attention → residual, LayerNorm → MLP → residual.
struct Block<B: Backend> {
    norm1: (B::Tensor, B::Tensor),
    qkv: (B::Matrix, B::Tensor),
    proj: (B::Matrix, B::Tensor),
    norm2: (B::Tensor, B::Tensor),
    fc1: (B::Matrix, B::Tensor),
    fc2: (B::Matrix, B::Tensor),
}

/// Qwen 3.5's vision tower and merger, loaded.
pub(crate) struct QwenVision<B: Backend> {
    cfg: QwenVisionConfig,
    /// The patch convolution as a product over unfolded cubes `[hidden, c·t·p·p]`.
    patch: (B::Matrix, B::Tensor),
    /// Learned positions `[num_position_embeddings][hidden]`, on the host for interpolation.
    positions: Vec<f32>,
    blocks: Vec<Block<B>>,
    merger_norm: (B::Tensor, B::Tensor),
    merger_fc1: (B::Matrix, B::Tensor),
    merger_fc2: (B::Matrix, B::Tensor),
}

fn name(s: &str) -> String {
    format!("{RAW_PREFIX}visual.{s}")
}

/// LayerNorm epsilon of the blocks and the merger (fixed in transformers' Qwen towers).
const EPS: f32 = 1e-6;

impl<B: Backend> QwenVision<B> {
    /// Whether `ld`'s weights hold the tower.
    pub(in crate::models) fn present(ld: &Loader<'_, B>) -> bool {
        ld.src.contains(&name("patch_embed.proj.weight"))
            && ld.src.contains(&name("merger.linear_fc2.weight"))
    }

    /// Whether `backend` has the ops the tower runs on.
    pub(crate) fn backend_can_run(backend: &B) -> bool {
        [
            OptionalOp::LayerNorm,
            OptionalOp::Activation,
            OptionalOp::AttentionTo,
        ]
        .into_iter()
        .all(|op| backend.supports(op))
    }

    pub(in crate::models) fn load(ld: &mut Loader<'_, B>, cfg: &QwenVisionConfig) -> Result<Self> {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let p = cfg.patch_size;
        let cube = cfg.channels * cfg.temporal_patch_size * p * p;
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
        // The convolution's kernel `[hidden, c, t, p, p]` is the matrix `[hidden, c·t·p·p]`.
        let conv = ld.required(&name("patch_embed.proj.weight"))?;
        ld.check(&conv, &[d, cfg.channels, cfg.temporal_patch_size, p, p])?;
        let conv = HostWeight {
            shape: vec![d, cube],
            ..conv
        };
        let patch_matrix = ld.backend.matrix(conv)?;
        let patch = (
            patch_matrix,
            ld.required_vector(&name("patch_embed.proj.bias"), d)?,
        );
        let pos = ld.required(&name("pos_embed.weight"))?;
        ld.check(&pos, &[cfg.num_position_embeddings, d])?;
        let positions = pos.float_values("vision position embedding")?;
        let mut blocks = Vec::with_capacity(cfg.depth);
        for i in 0..cfg.depth {
            let n = |s: &str| format!("blocks.{i}.{s}");
            blocks.push(Block {
                norm1: layer_norm(ld, &n("norm1"))?,
                qkv: linear(ld, &n("attn.qkv"), 3 * d, d)?,
                proj: linear(ld, &n("attn.proj"), d, d)?,
                norm2: layer_norm(ld, &n("norm2"))?,
                fc1: linear(ld, &n("mlp.linear_fc1"), f, d)?,
                fc2: linear(ld, &n("mlp.linear_fc2"), d, f)?,
            });
        }
        let merged = d * cfg.merge_size * cfg.merge_size;
        let merger_norm = layer_norm(ld, "merger.norm")?;
        let merger_fc1 = linear(ld, "merger.linear_fc1", merged, merged)?;
        let merger_fc2 = linear(ld, "merger.linear_fc2", cfg.out_hidden_size, merged)?;
        ld.bytes += (cfg.num_position_embeddings + cube) * d * 4;
        Ok(QwenVision {
            cfg: cfg.clone(),
            patch,
            positions,
            blocks,
            merger_norm,
            merger_fc1,
            merger_fc2,
        })
    }

    /// The configuration the tower was loaded with.
    pub(crate) fn config(&self) -> &QwenVisionConfig {
        &self.cfg
    }

    /// The image's soft-token rows in the text model's embedding space (merged grid cells in
    /// row-major order), `[rows·cols][out_hidden]` row-major, and the merged grid.
    pub(crate) fn embed(&self, be: &B, image: &ImagePixels) -> Result<(Vec<f32>, (usize, usize))> {
        let cfg = &self.cfg;
        if image.channels != cfg.channels
            || image.data.len() != image.channels * image.height * image.width
        {
            return Err(EngineError::InvalidInput(format!(
                "the vision tower reads {} channels; the image has {}×{}×{} ({} values)",
                cfg.channels,
                image.channels,
                image.height,
                image.width,
                image.data.len()
            )));
        }
        let (grid_rows, grid_cols) = cfg.merged_grid(image.height, image.width)?;
        let m = cfg.merge_size;
        let (gh, gw) = (grid_rows * m, grid_cols * m);
        let n = gh * gw;
        let d = cfg.hidden_size;
        // Each patch's (row, column) on the patch grid, in merge-window order.
        let cells: Vec<(usize, usize)> = (0..grid_rows)
            .flat_map(|br| (0..grid_cols).map(move |bc| (br, bc)))
            .flat_map(|(br, bc)| {
                (0..m).flat_map(move |r| (0..m).map(move |c| (br * m + r, bc * m + c)))
            })
            .collect();
        let cube = cfg.channels * cfg.temporal_patch_size * cfg.patch_size.pow(2);
        let mut x = be.linear(
            &be.tensor_from_host(self.unfold(image, &cells), n, cube)?,
            &self.patch.0,
            Some(&self.patch.1),
        )?;
        x = be.add(
            &x,
            &be.tensor_from_host(self.interpolated_positions(&cells, gh, gw), n, d)?,
        )?;

        let heads = cfg.num_heads;
        let head_dim = d / heads;
        let quarter = RopeSpec::base_inv_freq(cfg.rope_theta, head_dim / 2);
        let spec = RopeSpec {
            style: RopeStyle::Neox,
            dims: head_dim,
            inv_freq: [quarter.as_slice(), quarter.as_slice()].concat(),
            position_scale: 1.0,
            attention_factor: 1.0,
        };
        // The first half of the frequencies turn with the row, the second with the column.
        let axes: Vec<u8> = (0..head_dim / 2)
            .map(|i| if i < quarter.len() { 1 } else { 2 })
            .collect();
        let rope_positions: Vec<[usize; 3]> = cells.iter().map(|&(r, c)| [0, r, c]).collect();
        let rope = be.rope_table_axes(&rope_positions, &axes, &spec)?;
        let params = AttentionParams {
            heads,
            kv_heads: heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            softcap: None,
        };
        // Every patch sees every patch of its image.
        let ends = vec![n; n];
        for b in &self.blocks {
            let h = be.layer_norm(&x, &b.norm1.0, Some(&b.norm1.1), EPS)?;
            let qkv = be.linear(&h, &b.qkv.0, Some(&b.qkv.1))?;
            let [q, k, v] = <[B::Tensor; 3]>::try_from(be.split_columns(&qkv, &[d, d, d])?)
                .map_err(|_| EngineError::Backend {
                    backend: be.name(),
                    message: "split_columns returned the wrong number of parts".into(),
                })?;
            let q = be.rope(&q, heads, &rope)?;
            let k = be.rope(&k, heads, &rope)?;
            let mut scratch = be.new_kv_layer(heads, head_dim, None);
            let mut segments = [AttentionSegment {
                rows: 0..n,
                cache: &mut scratch,
            }];
            let a = be.attention_to(&q, &k, &v, &mut segments, &params, &ends)?;
            x = be.add(&x, &be.linear(&a, &b.proj.0, Some(&b.proj.1))?)?;
            let h = be.layer_norm(&x, &b.norm2.0, Some(&b.norm2.1), EPS)?;
            let mlp = be.activation(
                &be.linear(&h, &b.fc1.0, Some(&b.fc1.1))?,
                Activation::GeluTanh,
            )?;
            x = be.add(&x, &be.linear(&mlp, &b.fc2.0, Some(&b.fc2.1))?)?;
        }
        // The merger: LayerNorm per patch, each window's patches side by side, MLP.
        let normed = be.layer_norm(&x, &self.merger_norm.0, Some(&self.merger_norm.1), EPS)?;
        let host = be.rows_to_host(&normed, &[n])?.pop().unwrap_or_default();
        let tokens = grid_rows * grid_cols;
        let windows = be.tensor_from_host(host, tokens, d * m * m)?;
        let hidden = be.linear(&windows, &self.merger_fc1.0, Some(&self.merger_fc1.1))?;
        let mut hidden = be
            .rows_to_host(&hidden, &[tokens])?
            .pop()
            .unwrap_or_default();
        // The merger's GELU is the exact (erf) one.
        for v in &mut hidden {
            *v = 0.5 * *v * (1.0 + libm::erff(*v * std::f32::consts::FRAC_1_SQRT_2));
        }
        let hidden = be.tensor_from_host(hidden, tokens, d * m * m)?;
        let out = be.linear(&hidden, &self.merger_fc2.0, Some(&self.merger_fc2.1))?;
        let rows = be.rows_to_host(&out, &[tokens])?.pop().unwrap_or_default();
        Ok((rows, (grid_rows, grid_cols)))
    }

    /// The image's patch cubes as rows `[channel][frame][y][x]` (the still frame repeated),
    /// patches in `cells` order.
    fn unfold(&self, image: &ImagePixels, cells: &[(usize, usize)]) -> Vec<f32> {
        let cfg = &self.cfg;
        let (p, w, plane) = (cfg.patch_size, image.width, image.height * image.width);
        let mut out =
            Vec::with_capacity(cells.len() * cfg.channels * cfg.temporal_patch_size * p * p);
        for &(r, c) in cells {
            for ch in 0..cfg.channels {
                for _ in 0..cfg.temporal_patch_size {
                    for y in 0..p {
                        let at = ch * plane + (r * p + y) * w + c * p;
                        out.extend_from_slice(&image.data[at..at + p]);
                    }
                }
            }
        }
        out
    }

    /// The learned position grid resampled bilinearly (corners aligned) to the `gh × gw`
    /// patch grid, one row per cell of `cells`; computed in f32 as transformers does.
    fn interpolated_positions(&self, cells: &[(usize, usize)], gh: usize, gw: usize) -> Vec<f32> {
        let d = self.cfg.hidden_size;
        let side = self.cfg.grid_side();
        let taps = |index: usize, size: usize| -> [(usize, f32); 2] {
            let src = index as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let floor = src.floor();
            let mut out = [(0usize, 0f32); 2];
            for (o, slot) in out.iter_mut().enumerate() {
                let raw = floor + o as f32;
                let weight = (1.0 - (src - raw).abs()).max(0.0);
                *slot = ((raw as usize).min(side - 1), weight);
            }
            out
        };
        let mut out = vec![0f32; cells.len() * d];
        for (row, &(r, c)) in out.chunks_exact_mut(d).zip(cells) {
            let (hs, ws) = (taps(r, gh), taps(c, gw));
            for (hi, hw) in hs {
                for (wi, ww) in ws {
                    let weight = hw * ww;
                    let src = &self.positions[(hi * side + wi) * d..(hi * side + wi + 1) * d];
                    row.iter_mut().zip(src).for_each(|(o, v)| *o += v * weight);
                }
            }
        }
        out
    }
}
