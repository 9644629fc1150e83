//! Folding a LoRA adapter into its base model (`wick fuse`): `W += s·B·A` for every
//! projection the adapter changes, written as a new model folder that `wick serve` loads
//! without the adapter.
//!
//! - `safetensors.rs`: a Hugging Face folder. Each changed float matrix keeps its dtype
//!   (F32, F16, BF16); each changed MLX affine-quantized matrix is dequantized, fused and
//!   quantized again with its own bits and group size. Every other tensor keeps its
//!   bytes, the shards keep their names, and the folder's other files (config, tokenizer,
//!   generation config, chat template) are copied.
//! - `gguf.rs`: a GGUF file. Its metadata and untouched tensors keep their bytes; a
//!   changed matrix is written in its float type, or as F16 when it was quantized (wick
//!   has no GGUF quantizer), in the file's own (llama.cpp) Q/K row order.
//!
//! Adapters are read with the engine's loader ([`wick_engine::adapters::load_host`]), so
//! PEFT, mlx-lm and GGUF LoRA adapters all fuse, checked against the base's shapes before
//! anything is written. The output folder is built under a hidden temporary name beside
//! it and renamed into place.
mod gguf;
mod safetensors;

use std::path::{Path, PathBuf};

use wick_engine::adapters::{AdapterFormat, HostDelta, Target};
use wick_gguf::GgmlType;

use crate::error::{io, Result, TrainError};
use wick_engine::backend::tape::products::{gemm, Layout};

/// How the base stored the matrices the adapter changed (the first one's, where they differ).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FusedDtype {
    /// A float type kept as it was (`F32`, `F16`, `BF16`).
    Float(GgmlType),
    /// MLX affine quantization, re-quantized per module with its own `(bits, group size)`.
    MlxAffine {
        /// Bits per value.
        bits: u32,
        /// Values per group.
        group_size: usize,
    },
    /// A GGUF quantized type, written dequantized as `to`.
    Dequantized {
        /// The base file's type.
        from: GgmlType,
        /// The type written.
        to: GgmlType,
    },
}

impl std::fmt::Display for FusedDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FusedDtype::Float(t) => write!(f, "{}", t.to_string().to_lowercase()),
            FusedDtype::MlxAffine { bits, group_size } => {
                write!(f, "mlx-affine-{bits}bit-g{group_size}")
            }
            FusedDtype::Dequantized { from, to } => {
                write!(f, "{} (from {from})", to.to_string().to_lowercase())
            }
        }
    }
}

/// What a fuse wrote.
#[derive(Debug, Clone)]
pub struct FuseReport {
    /// The output folder.
    pub out: PathBuf,
    /// What `wick serve` loads: the folder, or the GGUF file in it.
    pub model_path: PathBuf,
    /// The base, as given.
    pub base: PathBuf,
    /// The adapter, as given.
    pub adapter: PathBuf,
    /// The adapter's file format.
    pub adapter_format: AdapterFormat,
    /// How the changed matrices were stored.
    pub dtype: FusedDtype,
    /// Projections changed.
    pub modules: usize,
    /// The files written, by name, with their sizes in bytes.
    pub files: Vec<(String, u64)>,
}

/// What one of the two writers made in the temporary folder.
struct Written {
    /// The model file inside the folder (GGUF), or `None` for a Hugging Face folder.
    model_file: Option<String>,
    adapter_format: AdapterFormat,
    dtype: FusedDtype,
    modules: usize,
}

/// Folds the adapter at `adapter` into the base model at `base` (a Hugging Face folder or
/// a GGUF file) and writes the fused model into the new folder `out`.
pub fn fuse(base: &Path, adapter: &Path, out: &Path) -> Result<FuseReport> {
    if out.exists() {
        return Err(TrainError::Fuse {
            path: out.to_path_buf(),
            reason: "it already exists; remove it or pick another --save-path".into(),
        });
    }
    let meta = std::fs::metadata(base).map_err(io(base))?;
    let is_gguf = meta.is_file();
    if !is_gguf && !base.join("config.json").is_file() {
        return Err(TrainError::Fuse {
            path: base.to_path_buf(),
            reason: "not a GGUF file nor a folder with config.json".into(),
        });
    }
    let tmp = temporary_beside(out);
    let written = if is_gguf {
        gguf::fuse_file(base, adapter, &tmp)
    } else {
        safetensors::fuse_folder(base, adapter, &tmp)
    };
    let written = match written {
        Ok(w) => w,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = std::fs::rename(&tmp, out) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(io(out)(e));
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(out).map_err(io(out))? {
        let entry = entry.map_err(io(out))?;
        let len = entry.metadata().map_err(io(out))?.len();
        files.push((entry.file_name().to_string_lossy().into_owned(), len));
    }
    files.sort();
    Ok(FuseReport {
        out: out.to_path_buf(),
        model_path: written
            .model_file
            .map_or_else(|| out.to_path_buf(), |f| out.join(f)),
        base: base.to_path_buf(),
        adapter: adapter.to_path_buf(),
        adapter_format: written.adapter_format,
        dtype: written.dtype,
        modules: written.modules,
        files,
    })
}

/// A fresh, hidden folder beside `path` to build it in (`.NAME.tmp-PID`), so that
/// listings never see a half-written model or adapter.
pub(crate) fn temporary_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    tmp
}

/// `w[row..row + out] += B·A` for one delta (`B` already holds the scale), `w` row-major
/// with the delta's input width: the whole matrix of a projection stored on its own, or
/// the delta's rows of a fused one ([`Site::row`]).
fn add_delta(w: &mut [f32], d: &HostDelta, row: usize) -> Result<()> {
    let rows = w
        .get_mut(row * d.in_dim..(row + d.out_dim) * d.in_dim)
        .ok_or_else(|| TrainError::Fuse {
            path: PathBuf::new(),
            reason: format!(
                "layer {} {}: rows {row}..{} are past the base matrix",
                d.layer,
                d.target.hf_module(),
                row + d.out_dim
            ),
        })?;
    gemm(
        d.out_dim,
        d.in_dim,
        d.rank,
        &d.b,
        Layout::Plain,
        &d.a,
        Layout::Plain,
        rows,
        true,
        1.0,
        true,
    );
    Ok(())
}

/// Where a delta lands in the base: the tensor's canonical name and the first of its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Site {
    tensor: String,
    row: usize,
}

/// Finds delta `d`'s matrix in the base through `shape_of` (a canonical name's `[rows,
/// cols]`, `None` where the base has no such matrix) and checks its shape. A projection the
/// base stores on its own takes the whole matrix; one the base stores fused (Phi-3's
/// `qkv_proj` and `gate_up_proj`, GLM-4's `gate_up_proj`: queries, keys, values or gate, up
/// stacked in that order) takes its rows of it, as PEFT's adapter of the fused module
/// holds them.
fn site(
    d: &HostDelta,
    base: &Path,
    shape_of: impl Fn(&str) -> Result<Option<[usize; 2]>>,
) -> Result<Site> {
    let what = format!("layer {} {}", d.layer, d.target.hf_module());
    let misfit = |shape: [usize; 2], of: &str| {
        refuse(
            base,
            format!(
                "{what} is {shape:?}{of} in the base but the adapter's delta is [{}, {}]",
                d.out_dim, d.in_dim
            ),
        )
    };
    let plain = canonical(d, base)?;
    if let Some(shape) = shape_of(&plain)? {
        if shape != [d.out_dim, d.in_dim] {
            return Err(misfit(shape, ""));
        }
        return Ok(Site {
            tensor: plain,
            row: 0,
        });
    }
    let fused = match d.target {
        Target::Q | Target::K | Target::V => Some("attn_qkv"),
        Target::Gate | Target::Up => Some("ffn_gate_up"),
        _ => None,
    };
    let fused = fused.map(|stem| format!("blk.{}.{stem}.weight", d.layer));
    let Some((tensor, [rows, cols])) = fused
        .map(|name| Ok::<_, TrainError>(shape_of(&name)?.map(|shape| (name, shape))))
        .transpose()?
        .flatten()
    else {
        return Err(refuse(base, format!("the base has no weight for {what}")));
    };
    let out = d.out_dim;
    // Queries and gates come first; keys, then values (as wide as the keys), and ups (as
    // wide as the gates) end the matrix.
    let row = match d.target {
        Target::Q => (rows > out).then_some(0),
        Target::K => rows.checked_sub(2 * out),
        Target::V | Target::Up => rows.checked_sub(out),
        _ => (rows == 2 * out).then_some(0),
    };
    match row {
        Some(row) if cols == d.in_dim && (d.target != Target::Up || rows == 2 * out) => {
            Ok(Site { tensor, row })
        }
        _ => Err(misfit([rows, cols], " (fused)")),
    }
}

/// A Fuse error about `path`.
/// The canonical name (`blk.N.<stem>.weight`) of the base matrix `d` adds to; the
/// projections the hybrid families add (DeltaNet, Qwen 3.5's gated query, Gemma 4's
/// per-layer inputs and router) are served beside the base but not folded into it yet.
fn canonical(d: &HostDelta, base: &Path) -> Result<String> {
    let stem = d.target.gguf_stem().ok_or_else(|| {
        refuse(
            base,
            format!(
                "the adapter changes layer {} {}: wick fuse folds the seven dense projections \
                 only (serve the adapter with --adapter instead)",
                d.layer,
                d.target.hf_module()
            ),
        )
    })?;
    Ok(format!("blk.{}.{stem}.weight", d.layer))
}

fn refuse(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Fuse {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}
