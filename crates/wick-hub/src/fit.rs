//! "Will it fit?": the memory a model needs at a context length, against the memory this
//! machine can give it, and the decode speed memory bandwidth allows.
//!
//! - weights: the tensor bytes the file headers declare (GGUF tensor directory,
//!   safetensors headers), not the file size;
//! - KV: per layer `2 × kv_heads × head_dim × bytes × tokens`, with the tokens of a
//!   sliding-window layer capped at its window, counted in the engine's KV blocks of
//!   [`wick_engine::kv_pool::BLOCK_TOKENS`] tokens (what the KV pool allocates);
//! - transient: `min(2048, ctx) × 0.55 MB` of activations and scratch;
//! - usable: `--memory-budget`, else 75 % of RAM (the smaller of `MemTotal` and the
//!   cgroup limit), or 90 % of the GPU's memory (NVML) for a GPU backend;
//! - the largest context that fits, capped at the model's context length;
//! - decode tok/s ≈ bandwidth / (weights + KV) × 0.82.
use std::path::{Path, PathBuf};

use serde::Serialize;
use wick_engine::backend::candle::KvDtype;
use wick_engine::config::ModelConfig;
use wick_engine::kv_pool::{block_bytes, blocks_for_tokens};

use crate::local_model::ModelKind;

/// Share of RAM a model may use (the rest is the OS, the server, the page cache).
pub const RAM_FRACTION: f64 = 0.75;
/// Share of a GPU's memory a model may use.
pub const VRAM_FRACTION: f64 = 0.9;
/// Prompt tokens processed in one chunk, for the transient estimate.
pub const CHUNK_TOKENS: usize = 2048;
/// Transient bytes per token of a chunk.
pub const TRANSIENT_BYTES_PER_TOKEN: f64 = 0.55e6;
/// Share of the bandwidth a dense decode step reaches.
pub const DECODE_EFFICIENCY: f64 = 0.82;

/// Why a model's fit could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// A file could not be read.
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The model's headers or configuration are not usable.
    #[error("{path}: {reason}")]
    Model {
        /// The model.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// One layer's KV shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerKv {
    /// KV heads × head size: the numbers of one token's keys (and of its values).
    pub row: usize,
    /// Sliding window, `None` for full attention.
    pub window: Option<usize>,
}

/// What the fit of a model depends on, read from its headers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitModel {
    /// The GGUF file or model directory.
    pub path: PathBuf,
    /// Architecture (`llama`, `qwen2` …).
    pub arch: String,
    /// Tensor bytes.
    pub weights_bytes: u64,
    /// Parameters (elements of every tensor).
    pub params: u64,
    /// The dominant tensor type by bytes (`Q4_1`, `BF16` …).
    pub quant: String,
    /// Each layer's KV shape.
    pub layers: Vec<LayerKv>,
    /// The model's context length.
    pub context_length: usize,
    /// The KV type serving uses by default (f16 for GGUF, f32 for safetensors).
    pub default_kv: KvDtype,
}

impl FitModel {
    /// Reads a model's headers (no weights are loaded).
    pub fn read(path: &Path, kind: ModelKind) -> Result<FitModel, FitError> {
        let bad = |reason: String| FitError::Model {
            path: path.to_path_buf(),
            reason,
        };
        let name = path.display().to_string();
        match kind {
            ModelKind::Gguf => {
                let file = wick_gguf::GgufFile::open(path).map_err(|e| bad(e.to_string()))?;
                let cfg = ModelConfig::from_gguf(file.metadata(), &name)
                    .map_err(|e| bad(e.to_string()))?;
                let mut by_type: Vec<(String, u64)> = Vec::new();
                let (mut weights, mut params) = (0u64, 0u64);
                for t in file.tensors() {
                    weights = weights.saturating_add(t.len);
                    params = params.saturating_add(t.elements());
                    add_bytes(&mut by_type, &t.dtype.to_string(), t.len);
                }
                Ok(FitModel::new(
                    path,
                    &cfg,
                    weights,
                    params,
                    dominant(by_type),
                    KvDtype::F16,
                ))
            }
            ModelKind::HfDir => {
                let config_path = path.join("config.json");
                let text =
                    std::fs::read_to_string(&config_path).map_err(|source| FitError::Io {
                        op: "read",
                        path: config_path.clone(),
                        source,
                    })?;
                let json: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| bad(format!("config.json: {e}")))?;
                let cfg = ModelConfig::from_hf(&json, &name).map_err(|e| bad(e.to_string()))?;
                let mut by_type: Vec<(String, u64)> = Vec::new();
                let (mut weights, mut params) = (0u64, 0u64);
                let mut shards: Vec<PathBuf> = std::fs::read_dir(path)
                    .map_err(|source| FitError::Io {
                        op: "list",
                        path: path.to_path_buf(),
                        source,
                    })?
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                    .collect();
                shards.sort();
                if shards.is_empty() {
                    return Err(bad("no .safetensors files".into()));
                }
                for shard in &shards {
                    for (dtype, bytes, elements) in safetensors_header(shard)? {
                        weights = weights.saturating_add(bytes);
                        params = params.saturating_add(elements);
                        add_bytes(&mut by_type, &dtype, bytes);
                    }
                }
                let quant = match json
                    .get("quantization_config")
                    .and_then(|q| q.get("bits"))
                    .and_then(serde_json::Value::as_u64)
                {
                    Some(bits) => format!("{bits}-bit"),
                    None => dominant(by_type),
                };
                Ok(FitModel::new(
                    path,
                    &cfg,
                    weights,
                    params,
                    quant,
                    KvDtype::F32,
                ))
            }
        }
    }

    fn new(
        path: &Path,
        cfg: &ModelConfig,
        weights: u64,
        params: u64,
        quant: String,
        kv: KvDtype,
    ) -> FitModel {
        FitModel {
            path: path.to_path_buf(),
            arch: cfg.arch.name().to_string(),
            weights_bytes: weights,
            params,
            quant,
            // One entry per KV cache the engine allocates: layers sharing another's cache
            // (Gemma 4) count once, linear-attention layers (Qwen 3.5) not at all.
            layers: cfg
                .cache_shapes()
                .into_iter()
                .map(|(row, window)| LayerKv { row, window })
                .collect(),
            context_length: cfg.context_length,
            default_kv: kv,
        }
    }

    /// KV bytes of `tokens` tokens of one sequence: what the engine's KV pool allocates
    /// (whole blocks; a sliding-window layer keeps at most its window).
    pub fn kv_bytes(&self, tokens: usize, kv: KvDtype) -> u64 {
        self.layers
            .iter()
            .map(|l| {
                let kept = l.window.map_or(tokens, |w| tokens.min(w));
                (blocks_for_tokens(kept) as u64)
                    .saturating_mul(block_bytes(l.row, kv.bytes()) as u64)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// The report at `ctx` tokens with `kv`, on `machine` with `usable` bytes.
    pub fn report(&self, ctx: usize, kv: KvDtype, machine: &Machine, usable: u64) -> FitReport {
        let transient = transient_bytes(ctx);
        let kv_bytes = self.kv_bytes(ctx, kv);
        let total = self
            .weights_bytes
            .saturating_add(kv_bytes)
            .saturating_add(transient);
        let need = |c: usize| {
            self.weights_bytes
                .saturating_add(self.kv_bytes(c, kv))
                .saturating_add(transient_bytes(c))
        };
        // Total memory grows with the context: binary search the largest that fits.
        let max_context = if need(1) > usable {
            0
        } else {
            let (mut lo, mut hi) = (1usize, self.context_length.max(1));
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if need(mid) <= usable {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            lo
        };
        let per_token = self.weights_bytes.saturating_add(kv_bytes).max(1);
        FitReport {
            fits: total <= usable,
            context_tokens: ctx,
            kv_type: kv.name(),
            weights_bytes: self.weights_bytes,
            kv_bytes,
            transient_bytes: transient,
            total_bytes: total,
            usable_bytes: usable,
            max_context,
            max_safe_context: max_context,
            predicted_decode_tps: machine.bandwidth_gbs * 1e9 / per_token as f64
                * DECODE_EFFICIENCY,
        }
    }
}

/// The context a report is for when none is asked: 8192 tokens, or the model's context
/// when shorter (the reference assesses libraries at 8192).
pub const DEFAULT_CTX: usize = 8192;

impl FitModel {
    /// The report at `ctx` (default [`DEFAULT_CTX`] capped at the model's context) with
    /// `kv` (default: the format's), using `budget` bytes or what `machine` gives.
    pub fn assess(
        &self,
        ctx: Option<usize>,
        kv: Option<KvDtype>,
        machine: &Machine,
        budget: Option<u64>,
    ) -> FitReport {
        let ctx = ctx.unwrap_or_else(|| DEFAULT_CTX.min(self.context_length));
        self.report(
            ctx,
            kv.unwrap_or(self.default_kv),
            machine,
            machine.usable_bytes(budget),
        )
    }

    /// The model on common machines at `ctx` tokens: (sku, memory GB, report).
    pub fn sku_matrix(&self, ctx: usize, kv: KvDtype) -> Vec<(&'static str, f64, FitReport)> {
        SKUS.iter()
            .map(|&(sku, gb, bw, gpu)| {
                let bytes = (gb * 1e9) as u64;
                let machine = Machine {
                    chip: sku.to_string(),
                    ram_bytes: bytes,
                    gpu: None,
                    bandwidth_gbs: bw,
                    bandwidth_source: "table",
                    measured_at: None,
                };
                let fraction = if gpu { VRAM_FRACTION } else { RAM_FRACTION };
                (
                    sku,
                    gb,
                    self.report(ctx, kv, &machine, (bytes as f64 * fraction) as u64),
                )
            })
            .collect()
    }
}

/// Common machines: (name, memory GB, bandwidth GB/s, is a GPU).
const SKUS: &[(&str, f64, f64, bool)] = &[
    ("cpu-16gb", 16.0, DEFAULT_CPU_BANDWIDTH_GBS, false),
    ("cpu-64gb", 64.0, DEFAULT_CPU_BANDWIDTH_GBS, false),
    ("NVIDIA L4", 24.0, 300.0, true),
    ("NVIDIA RTX 4090", 24.0, 1008.0, true),
    ("NVIDIA A100 80GB", 80.0, 2039.0, true),
    ("NVIDIA H100 80GB", 80.0, 3350.0, true),
    ("NVIDIA H200", 141.0, 4800.0, true),
];

fn add_bytes(by_type: &mut Vec<(String, u64)>, name: &str, bytes: u64) {
    match by_type.iter_mut().find(|(n, _)| n == name) {
        Some((_, b)) => *b += bytes,
        None => by_type.push((name.to_string(), bytes)),
    }
}

fn dominant(by_type: Vec<(String, u64)>) -> String {
    by_type
        .into_iter()
        .max_by_key(|(_, b)| *b)
        .map(|(n, _)| n.to_uppercase())
        .unwrap_or_default()
}

/// Transient bytes at `ctx` tokens.
pub fn transient_bytes(ctx: usize) -> u64 {
    (ctx.min(CHUNK_TOKENS) as f64 * TRANSIENT_BYTES_PER_TOKEN) as u64
}

/// (dtype, bytes, elements) of every tensor a safetensors header declares. The header's
/// length is checked against the file before it is read.
pub fn safetensors_header(path: &Path) -> Result<Vec<(String, u64, u64)>, FitError> {
    use std::io::Read;
    let io = |op| {
        move |source| FitError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    };
    let bad = |reason: String| FitError::Model {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = std::fs::File::open(path).map_err(io("open"))?;
    let file_len = file.metadata().map_err(io("stat"))?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io("read"))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > 100 << 20 || header_len + 8 > file_len {
        return Err(bad(format!(
            "safetensors header of {header_len} bytes does not fit the {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io("read"))?;
    let json: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("safetensors header: {e}")))?;
    let data_len = file_len - 8 - header_len;
    let mut out = Vec::new();
    for (name, t) in json.iter().filter(|(k, _)| *k != "__metadata__") {
        let offsets = t
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)));
        let Some((start, end)) = offsets.filter(|(s, e)| s <= e && *e <= data_len) else {
            return Err(bad(format!("tensor {name}: bad data_offsets")));
        };
        let elements = t
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|s| {
                s.iter()
                    .filter_map(|d| d.as_u64())
                    .fold(1u64, u64::saturating_mul)
            })
            .unwrap_or(0);
        let dtype = t
            .get("dtype")
            .and_then(|d| d.as_str())
            .unwrap_or("?")
            .to_string();
        out.push((dtype, end - start, elements));
    }
    Ok(out)
}

/// A fit report (the JSON of `wick fit --json` and `GET /fit`'s `report`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitReport {
    /// weights + KV + transient ≤ usable.
    pub fits: bool,
    /// The context the report is for.
    pub context_tokens: usize,
    /// The KV type it is for.
    pub kv_type: &'static str,
    /// Tensor bytes.
    pub weights_bytes: u64,
    /// KV bytes at `context_tokens`.
    pub kv_bytes: u64,
    /// Activation and scratch bytes.
    pub transient_bytes: u64,
    /// The sum.
    pub total_bytes: u64,
    /// What the model may use.
    pub usable_bytes: u64,
    /// The largest context that fits (0: not even the weights fit).
    pub max_context: usize,
    /// The same (the reference's name).
    pub max_safe_context: usize,
    /// Predicted decode tokens per second.
    pub predicted_decode_tps: f64,
}

/// A GPU NVML reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    /// Its name.
    pub name: String,
    /// Total memory.
    pub memory_bytes: u64,
    /// Free memory now.
    pub free_bytes: u64,
}

/// This machine, for fit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Machine {
    /// What the memory and bandwidth are of: `cpu` or the GPU's name.
    pub chip: String,
    /// RAM (the cgroup limit when lower).
    pub ram_bytes: u64,
    /// The first GPU, when NVML is present.
    pub gpu: Option<Gpu>,
    /// Memory bandwidth in GB/s.
    pub bandwidth_gbs: f64,
    /// `calibrated` (measured by `wick bench --calibrate`) or `table`.
    pub bandwidth_source: &'static str,
    /// When the calibration was measured (Unix seconds).
    pub measured_at: Option<f64>,
}

/// Where the model runs, for the memory and bandwidth it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// Host RAM.
    Cpu,
    /// The first GPU when NVML finds one, else host RAM.
    Gpu,
}

/// Decimal GB/s of memory bandwidth by GPU name (substring, first match).
const GPU_BANDWIDTH: &[(&str, f64)] = &[
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("GH200", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("T4", 320.0),
    ("V100", 900.0),
    ("RTX 5090", 1792.0),
    ("RTX 4090", 1008.0),
    ("RTX 4080", 717.0),
    ("RTX 3090", 936.0),
    ("RTX 3080", 760.0),
];

/// The host's bandwidth when not calibrated: a dual-channel DDR4/DDR5 desktop or a cloud
/// VM's share.
pub const DEFAULT_CPU_BANDWIDTH_GBS: f64 = 20.0;

/// The table's bandwidth for a chip.
pub fn table_bandwidth(chip: &str) -> f64 {
    GPU_BANDWIDTH
        .iter()
        .find(|(n, _)| chip.contains(n))
        .map(|(_, b)| *b)
        .unwrap_or(if chip == "cpu" {
            DEFAULT_CPU_BANDWIDTH_GBS
        } else {
            500.0
        })
}

/// A stored bandwidth measurement (`$WICK_HOME/calibration.json`).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Calibration {
    /// The chip it was measured on.
    pub chip: String,
    /// GB/s.
    pub bandwidth_gbs: f64,
    /// Unix seconds.
    pub measured_at: f64,
}

/// The calibration file in the store at `root`.
pub fn calibration_path(root: &Path) -> PathBuf {
    root.join("calibration.json")
}

/// Reads the calibration, if one was stored.
pub fn read_calibration(root: &Path) -> Option<Calibration> {
    let text = std::fs::read_to_string(calibration_path(root)).ok()?;
    serde_json::from_str::<Calibration>(&text)
        .ok()
        .filter(|c| c.bandwidth_gbs.is_finite() && c.bandwidth_gbs > 0.0)
}

/// Stores a calibration.
pub fn write_calibration(root: &Path, c: &Calibration) -> std::io::Result<()> {
    std::fs::create_dir_all(root)?;
    let path = calibration_path(root);
    let tmp = path.with_extension("json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(c).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(tmp, path)
}

/// Measures host memory read bandwidth (GB/s): every core sums its part of a 512 MiB
/// buffer, best of a few passes.
pub fn measure_host_bandwidth() -> f64 {
    let words = (512usize << 20) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let chunk = words.div_ceil(threads);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let start = std::time::Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(chunk)
                .map(|part| s.spawn(move || part.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        let secs = start.elapsed().as_secs_f64();
        if secs > 0.0 {
            best = best.max((words * 8) as f64 / secs / 1e9);
        }
    }
    best
}

/// RAM: `MemTotal`, or the cgroup (v2 or v1) memory limit when it is lower.
pub fn ram_bytes() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0);
    let limit = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .filter_map(|p| std::fs::read_to_string(p).ok())
    .filter_map(|s| s.trim().parse::<u64>().ok())
    .min();
    match limit {
        Some(l) if l > 0 && (total == 0 || l < total) => l,
        _ => total,
    }
}

impl Machine {
    /// Detects this machine for `device`; the calibration in `store_root` wins over the
    /// table when it is for the same chip.
    pub fn detect(device: Device, store_root: &Path) -> Machine {
        let gpu = match device {
            Device::Gpu => crate::nvml::first_gpu(),
            Device::Cpu => None,
        };
        let chip = gpu
            .as_ref()
            .map_or_else(|| "cpu".to_string(), |g| g.name.clone());
        let calibration = read_calibration(store_root).filter(|c| c.chip == chip);
        Machine {
            bandwidth_gbs: calibration
                .as_ref()
                .map_or_else(|| table_bandwidth(&chip), |c| c.bandwidth_gbs),
            bandwidth_source: if calibration.is_some() {
                "calibrated"
            } else {
                "table"
            },
            measured_at: calibration.map(|c| c.measured_at),
            ram_bytes: ram_bytes(),
            chip,
            gpu,
        }
    }

    /// What a model may use: `budget` when given, else 90 % of the GPU's memory or 75 %
    /// of RAM.
    pub fn usable_bytes(&self, budget: Option<u64>) -> u64 {
        match (budget, &self.gpu) {
            (Some(b), _) => b,
            (None, Some(g)) => (g.memory_bytes as f64 * VRAM_FRACTION) as u64,
            (None, None) => (self.ram_bytes as f64 * RAM_FRACTION) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Machine {
        Machine {
            chip: "cpu".into(),
            ram_bytes: 16 << 30,
            gpu: None,
            bandwidth_gbs: 20.0,
            bandwidth_source: "table",
            measured_at: None,
        }
    }

    fn model(layers: Vec<LayerKv>) -> FitModel {
        FitModel {
            path: PathBuf::from("m"),
            arch: "llama".into(),
            weights_bytes: 100_000_000,
            params: 0,
            quant: "Q4_1".into(),
            layers,
            context_length: 8192,
            default_kv: KvDtype::F16,
        }
    }

    #[test]
    fn kv_bytes_follow_the_formula_and_windows() {
        // SmolLM2-135M: 30 layers of 3 KV heads × 64.
        let m = model(vec![
            LayerKv {
                row: 192,
                window: None
            };
            30
        ]);
        assert_eq!(m.kv_bytes(4096, KvDtype::F16), 30 * 2 * 192 * 2 * 4096);
        assert_eq!(m.kv_bytes(4096, KvDtype::F32), 2 * 30 * 2 * 192 * 2 * 4096);
        // Whole blocks: 17 tokens take two blocks of 16.
        assert_eq!(m.kv_bytes(17, KvDtype::F16), 30 * 2 * 192 * 2 * 32);
        let mixed = model(vec![
            LayerKv {
                row: 64,
                window: Some(512),
            },
            LayerKv {
                row: 64,
                window: None,
            },
        ]);
        assert_eq!(
            mixed.kv_bytes(4096, KvDtype::F16),
            (2 * 64 * 2 * 512 + 2 * 64 * 2 * 4096) as u64
        );
        assert_eq!(mixed.kv_bytes(256, KvDtype::F16), 2 * (2 * 64 * 2 * 256));
    }

    #[test]
    fn reports_and_the_largest_context() {
        let m = model(vec![
            LayerKv {
                row: 192,
                window: None
            };
            30
        ]);
        let r = m.report(4096, KvDtype::F16, &machine(), 8 << 30);
        assert!(r.fits);
        assert_eq!(r.transient_bytes, (2048.0 * 0.55e6) as u64);
        assert_eq!(
            r.total_bytes,
            r.weights_bytes + r.kv_bytes + r.transient_bytes
        );
        assert_eq!(r.max_context, 8192, "capped at the model's context");
        // A budget just above the weights and transient: the context solves exactly.
        let usable = 100_000_000 + transient_bytes(2048) + m.kv_bytes(1000, KvDtype::F16);
        let r = m.report(4096, KvDtype::F16, &machine(), usable);
        assert!(!r.fits);
        let need = |c: usize| 100_000_000 + m.kv_bytes(c, KvDtype::F16) + transient_bytes(c);
        let brute = (1..=8192).rev().find(|&c| need(c) <= usable).unwrap();
        assert_eq!(r.max_context, brute);
        assert!(
            r.max_context > 1000 && r.max_context < 4096,
            "{}",
            r.max_context
        );
        let r = m.report(4096, KvDtype::F16, &machine(), 1000);
        assert_eq!(r.max_context, 0);
        let expect = 20e9 / (100_000_000 + m.kv_bytes(4096, KvDtype::F16)) as f64 * 0.82;
        assert!((r.predicted_decode_tps - expect).abs() < 1e-9);
    }

    #[test]
    fn bandwidth_table() {
        assert_eq!(table_bandwidth("NVIDIA H200"), 4800.0);
        assert_eq!(table_bandwidth("NVIDIA H100 80GB HBM3"), 3350.0);
        assert_eq!(table_bandwidth("cpu"), DEFAULT_CPU_BANDWIDTH_GBS);
    }

    #[test]
    fn safetensors_headers_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        let header = br#"{"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"__metadata__":{"format":"pt"}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0u8; 12]);
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(
            safetensors_header(&p).unwrap(),
            vec![("BF16".to_string(), 12, 6)]
        );
        // Offsets past the data, and a header longer than the file, are refused.
        bytes.truncate(bytes.len() - 1);
        std::fs::write(&p, &bytes).unwrap();
        assert!(safetensors_header(&p).is_err());
        let mut huge = (1u64 << 40).to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        std::fs::write(&p, &huge).unwrap();
        assert!(safetensors_header(&p).is_err());
    }
}
