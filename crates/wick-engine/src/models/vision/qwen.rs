//! Qwen-VL vision towers: a patch embedding over `temporal × p × p` cubes (a still image
//! repeats its frame), pre-norm blocks whose attention turns queries and keys with a 2-D
//! (row, column) rotary, and the merger that joins each `merge × merge` window of patches
//! into one row of the text model's width. Two generations ([`QwenTower`]):
//!
//! - Qwen 3.5: learned positions interpolated to the image's patch grid, LayerNorms, a GELU
//!   MLP, every block attending over the whole image;
//! - Qwen2.5-VL: no learned positions, RMSNorms, a SwiGLU MLP, and window attention: the
//!   merged tokens are grouped in square windows (`window_size` pixels), patches run window
//!   by window, and all blocks but `fullatt_block_indexes` attend within their window; the
//!   merger's rows are put back in grid order at the end.
//!
//! Patches run in merge-window order (window row, window column, row and column inside the
//! window), as transformers' processor emits them, so that each window's patches are
//! consecutive rows for the merger. The input is the processed image `[c, h, w]`; the
//! unfolding into patches, the position interpolation and the merger's exact GELU are done
//! on the host, the rest through the [`Backend`] ops the text model uses.
use serde_json::Value;

use crate::backend::{
    Activation, AttentionParams, AttentionSegment, Backend, HostWeight, RopeSpec, RopeStyle,
};
use crate::config::media::{QwenTower, QwenVisionConfig};
use crate::config::HfKeys;
use crate::media::{ImagePixels, VisionCaps, VisionProcessor};
use crate::models::decoder::loader::Loader;
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

/// The smallest per-channel standard deviation a preprocessor config may give.
const MIN_IMAGE_STD: f32 = 1e-3;

impl QwenVisionConfig {
    /// Reads a Qwen 3.5 or Qwen2.5-VL `config.json` (`qwen25`); `None` when it has no
    /// `vision_config` (a text-only checkpoint).
    pub(crate) fn from_hf(json: &Value, source: &str, qwen25: bool) -> Result<Option<Self>> {
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
        let act = keys.get("hidden_act").and_then(Value::as_str);
        if qwen25 && act.is_some_and(|a| a != "silu") {
            return Err(keys.bad(
                "hidden_act",
                "is not SiLU (the one wick implements for Qwen2.5-VL)",
            ));
        }
        if !qwen25
            && act.is_some_and(|a| !matches!(a, "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast"))
        {
            return Err(keys.bad("hidden_act", "is not a tanh GELU (the one wick implements)"));
        }
        let depth = bounded("depth", None, MAX_DEPTH)?;
        let tower = if qwen25 {
            let full_blocks: Vec<usize> = vision
                .get("fullatt_block_indexes")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_u64)
                        .map(|v| v as usize)
                        .collect()
                })
                .unwrap_or_default();
            if full_blocks.iter().any(|&b| b >= depth) {
                return Err(keys.bad("fullatt_block_indexes", "names a block past depth"));
            }
            QwenTower::Qwen25 {
                window_size: bounded("window_size", Some(112), 1 << 16)?,
                full_blocks,
            }
        } else {
            QwenTower::Qwen35
        };
        let rope_theta = vision
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0);
        let clip_mean = [0.481_454_66, 0.457_827_5, 0.408_210_73];
        let clip_std = [0.268_629_54, 0.261_302_6, 0.275_777_1];
        let cfg = QwenVisionConfig {
            depth,
            hidden_size: bounded("hidden_size", None, MAX_WIDTH)?,
            intermediate_size: bounded("intermediate_size", None, 4 * MAX_WIDTH)?,
            num_heads: bounded("num_heads", None, MAX_WIDTH)?,
            channels: bounded("in_channels", Some(3), 4)?,
            patch_size: bounded("patch_size", Some(16), 1024)?,
            temporal_patch_size: bounded("temporal_patch_size", Some(2), 16)?,
            merge_size: bounded("spatial_merge_size", Some(2), 16)?,
            out_hidden_size: bounded("out_hidden_size", None, MAX_WIDTH)?,
            num_position_embeddings: if qwen25 {
                0
            } else {
                bounded("num_position_embeddings", None, MAX_POSITIONS)?
            },
            rope_theta,
            image_token_id: id("image_token_id", if qwen25 { 151_655 } else { 248_056 })?,
            vision_start_token_id: id(
                "vision_start_token_id",
                if qwen25 { 151_652 } else { 248_053 },
            )?,
            vision_end_token_id: id(
                "vision_end_token_id",
                if qwen25 { 151_653 } else { 248_054 },
            )?,
            // The processors' defaults: Qwen 3.5 (Qwen3-VL's) 64 Ki to 16 Mi pixels with
            // mean/std 0.5; Qwen2.5-VL 56² to 28²·16384 pixels with CLIP's mean/std.
            min_pixels: if qwen25 { 3_136 } else { 65_536 },
            max_pixels: if qwen25 { 12_845_056 } else { 16_777_216 },
            image_mean: if qwen25 { clip_mean } else { [0.5; 3] },
            image_std: if qwen25 { clip_std } else { [0.5; 3] },
            tower,
        };
        cfg.check(source)?;
        Ok(Some(cfg))
    }

    /// Takes the pixel budget and normalisation from the directory's
    /// `preprocessor_config.json` (`min_pixels` / `max_pixels`, else `size.shortest_edge` /
    /// `size.longest_edge`; `image_mean`, `image_std`). The flat keys win where both are
    /// written, as transformers' processor lets them override `size`.
    pub(crate) fn with_preprocessor(mut self, json: &Value, source: &str) -> Result<Self> {
        let keys = HfKeys { json, source };
        let size = json.get("size");
        let pixels = |edge: &str, flat: &str| -> Result<Option<usize>> {
            match keys.opt_usize(flat)? {
                Some(v) => Ok(Some(v)),
                None => Ok(size
                    .and_then(|s| s.get(edge))
                    .and_then(Value::as_u64)
                    .map(|v| v as usize)),
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
            // Every entry a number (one that is not was dropped, shifting the channels).
            let vals: Option<Vec<f32>> = v
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_f64().map(|x| x as f32)).collect());
            <[f32; 3]>::try_from(vals.unwrap_or_default())
                .map(Some)
                .map_err(|_| keys.bad(key, "must be three numbers"))
        };
        // Pixels are (x − mean) / std in f32: a std of 0 or 1e-40 made them infinite.
        if let Some(m) = triple("image_mean")? {
            if !m.iter().all(|v| v.is_finite() && v.abs() <= 1e3) {
                return Err(keys.bad("image_mean", "must be finite, within ±1000"));
            }
            self.image_mean = m;
        }
        if let Some(s) = triple("image_std")? {
            if !s.iter().all(|v| (MIN_IMAGE_STD..=1e3).contains(v)) {
                return Err(keys.bad("image_std", "must be within 0.001..=1000"));
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
        let reason = if !self.hidden_size.is_multiple_of(self.num_heads)
            || !head_dim.is_multiple_of(4)
        {
            Some(format!(
                "vision hidden_size {} over {} heads is not a head width divisible by 4 (the 2-D rotary needs it)",
                self.hidden_size, self.num_heads
            ))
        } else if self.tower == QwenTower::Qwen35 && side * side != self.num_position_embeddings {
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

/// A norm's scale, and its bias for a LayerNorm (none: an RMSNorm).
struct Norm<B: Backend> {
    weight: B::Tensor,
    bias: Option<B::Tensor>,
}

/// A block's MLP.
enum Mlp<B: Backend> {
    /// `fc2(gelu_tanh(fc1(x)))` (Qwen 3.5).
    Plain {
        fc1: (B::Matrix, B::Tensor),
        fc2: (B::Matrix, B::Tensor),
    },
    /// `down(silu(gate(x)) · up(x))` (Qwen2.5-VL).
    Gated {
        gate: (B::Matrix, B::Tensor),
        up: (B::Matrix, B::Tensor),
        down: (B::Matrix, B::Tensor),
    },
}

/// One block: norm → attention → residual, norm → MLP → residual.
struct Block<B: Backend> {
    norm1: Norm<B>,
    qkv: (B::Matrix, B::Tensor),
    proj: (B::Matrix, B::Tensor),
    norm2: Norm<B>,
    mlp: Mlp<B>,
    /// Whether the block attends over the whole image (else within its window).
    full: bool,
}

/// A Qwen vision tower and merger, loaded.
pub(crate) struct QwenVision<B: Backend> {
    cfg: QwenVisionConfig,
    /// The patch convolution as a product over unfolded cubes `[hidden, c·t·p·p]`.
    patch: (B::Matrix, Option<B::Tensor>),
    /// Learned positions `[num_position_embeddings][hidden]`, on the host for interpolation
    /// (empty for towers without them).
    positions: Vec<f32>,
    blocks: Vec<Block<B>>,
    merger_norm: Norm<B>,
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
            && (ld.src.contains(&name("merger.linear_fc2.weight"))
                || ld.src.contains(&name("merger.mlp.2.weight")))
    }

    pub(in crate::models) fn load(ld: &mut Loader<'_, B>, cfg: &QwenVisionConfig) -> Result<Self> {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let p = cfg.patch_size;
        let cube = cfg.channels * cfg.temporal_patch_size * p * p;
        let qwen25 = cfg.tower != QwenTower::Qwen35;
        let linear = |ld: &mut Loader<'_, B>, n: &str, rows: usize, cols: usize| {
            Ok::<_, EngineError>((
                ld.matrix(&name(&format!("{n}.weight")), rows, cols)?,
                ld.required_vector(&name(&format!("{n}.bias")), rows)?,
            ))
        };
        // Qwen 3.5 normalises with LayerNorms (scale and bias), Qwen2.5-VL with RMSNorms.
        let norm = |ld: &mut Loader<'_, B>, n: &str| {
            Ok::<_, EngineError>(Norm {
                weight: ld.required_vector(&name(&format!("{n}.weight")), d)?,
                bias: if qwen25 {
                    None
                } else {
                    Some(ld.required_vector(&name(&format!("{n}.bias")), d)?)
                },
            })
        };
        // The convolution's kernel `[hidden, c, t, p, p]` is the matrix `[hidden, c·t·p·p]`.
        let conv = ld.required(&name("patch_embed.proj.weight"))?;
        ld.check(&conv, &[d, cfg.channels, cfg.temporal_patch_size, p, p])?;
        let conv = HostWeight {
            shape: vec![d, cube],
            ..conv
        };
        let patch_matrix = ld.backend.matrix(conv)?;
        let patch_bias = if qwen25 {
            None
        } else {
            Some(ld.required_vector(&name("patch_embed.proj.bias"), d)?)
        };
        let positions = if qwen25 {
            Vec::new()
        } else {
            let pos = ld.required(&name("pos_embed.weight"))?;
            ld.check(&pos, &[cfg.num_position_embeddings, d])?;
            pos.float_values("vision position embedding")?
        };
        let full_blocks = match &cfg.tower {
            QwenTower::Qwen35 => None,
            QwenTower::Qwen25 { full_blocks, .. } => Some(full_blocks),
        };
        let mut blocks = Vec::with_capacity(cfg.depth);
        for i in 0..cfg.depth {
            let n = |s: &str| format!("blocks.{i}.{s}");
            let mlp = if qwen25 {
                Mlp::Gated {
                    gate: linear(ld, &n("mlp.gate_proj"), f, d)?,
                    up: linear(ld, &n("mlp.up_proj"), f, d)?,
                    down: linear(ld, &n("mlp.down_proj"), d, f)?,
                }
            } else {
                Mlp::Plain {
                    fc1: linear(ld, &n("mlp.linear_fc1"), f, d)?,
                    fc2: linear(ld, &n("mlp.linear_fc2"), d, f)?,
                }
            };
            blocks.push(Block {
                norm1: norm(ld, &n("norm1"))?,
                qkv: linear(ld, &n("attn.qkv"), 3 * d, d)?,
                proj: linear(ld, &n("attn.proj"), d, d)?,
                norm2: norm(ld, &n("norm2"))?,
                mlp,
                full: full_blocks.is_none_or(|b| b.contains(&i)),
            });
        }
        let merged = d * cfg.merge_size * cfg.merge_size;
        let (norm_name, fc1_name, fc2_name) = if qwen25 {
            ("merger.ln_q", "merger.mlp.0", "merger.mlp.2")
        } else {
            ("merger.norm", "merger.linear_fc1", "merger.linear_fc2")
        };
        let merger_norm = norm(ld, norm_name)?;
        let merger_fc1 = linear(ld, fc1_name, merged, merged)?;
        let merger_fc2 = linear(ld, fc2_name, cfg.out_hidden_size, merged)?;
        ld.bytes += (cfg.num_position_embeddings + cube) * d * 4;
        Ok(QwenVision {
            cfg: cfg.clone(),
            patch: (patch_matrix, patch_bias),
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
        let (order, windows) = self.token_order(grid_rows, grid_cols);
        // Each patch's (row, column) on the patch grid: the merged tokens in run order, the
        // patches of one token consecutive (row-major inside the token).
        let cells: Vec<(usize, usize)> = order
            .iter()
            .map(|&t| (t / grid_cols, t % grid_cols))
            .flat_map(|(br, bc)| {
                (0..m).flat_map(move |r| (0..m).map(move |c| (br * m + r, bc * m + c)))
            })
            .collect();
        let cube = cfg.channels * cfg.temporal_patch_size * cfg.patch_size.pow(2);
        let mut x = be.linear(
            &be.tensor_from_host(self.unfold(image, &cells), n, cube)?,
            &self.patch.0,
            self.patch.1.as_ref(),
        )?;
        if !self.positions.is_empty() {
            let pos = self.interpolated_positions(&cells, gh, gw);
            x = be.add(&x, &be.tensor_from_host(pos, n, d)?)?;
        }

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
        // Patch ranges of the windows, and for each patch the end of what it sees (every
        // patch of its window, or of the image).
        let mut window_rows = Vec::with_capacity(windows.len());
        let mut window_ends = Vec::with_capacity(n);
        let mut at = 0;
        for &w in &windows {
            let len = w * m * m;
            window_rows.push(at..at + len);
            window_ends.extend(std::iter::repeat_n(len, len));
            at += len;
        }
        let whole = 0..n;
        let image_ends = vec![n; n];
        for b in &self.blocks {
            let (rows, ends) = if b.full {
                (std::slice::from_ref(&whole), &image_ends)
            } else {
                (&window_rows[..], &window_ends)
            };
            let h = self.norm(be, &x, &b.norm1)?;
            let qkv = be.linear(&h, &b.qkv.0, Some(&b.qkv.1))?;
            let [q, k, v] = <[B::Tensor; 3]>::try_from(be.split_columns(&qkv, &[d, d, d])?)
                .map_err(|_| EngineError::Backend {
                    backend: be.name(),
                    message: "split_columns returned the wrong number of parts".into(),
                })?;
            let q = be.rope(&q, heads, &rope)?;
            let k = be.rope(&k, heads, &rope)?;
            let mut scratch: Vec<B::KvLayer> = rows
                .iter()
                .map(|_| be.new_kv_layer(heads, head_dim, None))
                .collect();
            let mut segments: Vec<AttentionSegment<'_, B::KvLayer>> = rows
                .iter()
                .zip(scratch.iter_mut())
                .map(|(r, cache)| AttentionSegment {
                    rows: r.clone(),
                    cache,
                })
                .collect();
            let a = be.attention_to(&q, &k, &v, &mut segments, &params, ends)?;
            x = be.add(&x, &be.linear(&a, &b.proj.0, Some(&b.proj.1))?)?;
            let h = self.norm(be, &x, &b.norm2)?;
            let mlp = match &b.mlp {
                Mlp::Plain { fc1, fc2 } => {
                    let hidden =
                        be.activation(&be.linear(&h, &fc1.0, Some(&fc1.1))?, Activation::GeluTanh)?;
                    be.linear(&hidden, &fc2.0, Some(&fc2.1))?
                }
                Mlp::Gated { gate, up, down } => {
                    let g = be.linear(&h, &gate.0, Some(&gate.1))?;
                    let u = be.linear(&h, &up.0, Some(&up.1))?;
                    let hidden = be.glu(&g, &u, Activation::Silu)?;
                    be.linear(&hidden, &down.0, Some(&down.1))?
                }
            };
            x = be.add(&x, &mlp)?;
        }
        // The merger: norm per patch, each token's patches side by side, MLP.
        let normed = self.norm(be, &x, &self.merger_norm)?;
        let host = be.rows_to_host(&normed, &[n])?.pop().unwrap_or_default();
        let tokens = grid_rows * grid_cols;
        let joined = be.tensor_from_host(host, tokens, d * m * m)?;
        let hidden = be.linear(&joined, &self.merger_fc1.0, Some(&self.merger_fc1.1))?;
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
        let run = be.rows_to_host(&out, &[tokens])?.pop().unwrap_or_default();
        // Back to grid order.
        let width = cfg.out_hidden_size;
        let mut rows = vec![0f32; run.len()];
        for (k, &t) in order.iter().enumerate() {
            rows[t * width..(t + 1) * width].copy_from_slice(&run[k * width..(k + 1) * width]);
        }
        Ok((rows, (grid_rows, grid_cols)))
    }

    /// The norm of `x`: a LayerNorm when it has a bias, else an RMSNorm.
    fn norm(&self, be: &B, x: &B::Tensor, norm: &Norm<B>) -> Result<B::Tensor> {
        match &norm.bias {
            Some(bias) => be.layer_norm(x, &norm.weight, Some(bias), EPS),
            None => be.rms_norm(x, &norm.weight, EPS),
        }
    }

    /// The order the merged tokens (row-major indices on the `rows × cols` merged grid) run
    /// through the blocks, and how many tokens each attention window holds: the grid in
    /// one window (Qwen 3.5), or square windows of `window_size` pixels, row by row, each
    /// window's tokens row-major (Qwen2.5-VL; windows at the right and bottom edges are cut).
    fn token_order(&self, rows: usize, cols: usize) -> (Vec<usize>, Vec<usize>) {
        let QwenTower::Qwen25 { window_size, .. } = &self.cfg.tower else {
            return ((0..rows * cols).collect(), vec![rows * cols]);
        };
        let w = (window_size / self.cfg.merge_size / self.cfg.patch_size).max(1);
        let mut order = Vec::with_capacity(rows * cols);
        let mut windows = Vec::new();
        for wr in (0..rows).step_by(w) {
            for wc in (0..cols).step_by(w) {
                let before = order.len();
                for r in wr..(wr + w).min(rows) {
                    order.extend((wc..(wc + w).min(cols)).map(|c| r * cols + c));
                }
                windows.push(order.len() - before);
            }
        }
        (order, windows)
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
