//! Adapters on disk, in both layouts at once: PEFT's (`adapter_model.safetensors`,
//! `lora_A [r, in]`, `lora_B [out, r]`) and mlx-lm's (`adapters.safetensors`,
//! `lora_a [in, r]`, `lora_b [r, out]`), under one `adapter_config.json` that carries
//! both tools' keys, so `wick serve --adapter`, PEFT and `mlx_lm` load the same folder;
//! plus the optimizer state and step a checkpoint needs to resume
//! (`optimizer.safetensors`, `trainer_state.json`). Every file is written under a
//! temporary name and renamed, so a reader never sees half a file.
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use wick_engine::adapters::Target;
use wick_engine::config::Arch;
use wick_engine::weights::SafetensorsWeights;
use wick_gguf::GgmlType;

use crate::error::{io, Result, TrainError};
use crate::lora::{peft_name, peft_name_of, LoraConfig, LoraParams};
use crate::optim::AdamW;

/// The weights file of a PEFT adapter.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The weights file of an mlx-lm adapter.
pub const MLX_WEIGHTS_FILE: &str = "adapters.safetensors";
/// The config file of a PEFT adapter.
pub const CONFIG_FILE: &str = "adapter_config.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "trainer_state.json";

fn peft_key(arch: Arch, layer: usize, t: Target, factor: &str) -> String {
    format!(
        "base_model.model.model.layers.{layer}.{}.lora_{factor}.weight",
        t.hf_module_of(arch)
    )
}

/// Writes `bytes` to `path` through a temporary file in the same directory.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// A safetensors file of f32 tensors.
fn safetensors_bytes<D: AsRef<[f32]>>(tensors: &[(String, Vec<usize>, D)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let end = offset + data.as_ref().len() * 4;
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut head = Value::Object(header).to_string().into_bytes();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + head.len() + offset);
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    for (_, _, data) in tensors {
        for v in data.as_ref() {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

fn factor_tensors<'a>(
    params: &'a LoraParams,
    prefix: &str,
) -> Vec<(String, Vec<usize>, &'a [f32])> {
    let r = params.rank;
    let mut out = Vec::new();
    for (l, t, p) in params.iter() {
        out.push((
            format!("{prefix}{}", peft_key(params.arch, l, t, "A")),
            vec![r, p.in_dim],
            &p.a[..],
        ));
        out.push((
            format!("{prefix}{}", peft_key(params.arch, l, t, "B")),
            vec![p.out_dim, r],
            &p.b[..],
        ));
    }
    out
}

/// `[rows, cols]` row-major → `[cols, rows]`.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

/// mlx-lm's tensors: `model.layers.N.<module>.lora_a` `[in, r]`, `lora_b` `[r, out]`.
fn mlx_tensors(params: &LoraParams) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let r = params.rank;
    let mut out = Vec::new();
    for (l, t, p) in params.iter() {
        let module = format!("model.layers.{l}.{}", t.hf_module_of(params.arch));
        out.push((
            format!("{module}.lora_a"),
            vec![p.in_dim, r],
            transpose(&p.a, r, p.in_dim),
        ));
        out.push((
            format!("{module}.lora_b"),
            vec![r, p.out_dim],
            transpose(&p.b, p.out_dim, r),
        ));
    }
    out
}

/// The `adapter_config.json` of `lora` (its factors `params`) on a model of `layers`
/// layers: PEFT's keys (`r`, `lora_alpha`, `use_rslora`, `layers_to_transform`, …) and
/// mlx-lm's (`fine_tune_type`, `num_layers`, `lora_parameters` with the absolute scale).
/// The modules are named as the base's architecture names them, those it has.
pub fn peft_config(
    lora: &LoraConfig,
    params: &LoraParams,
    layers: usize,
    base_model: &str,
) -> Value {
    let first = lora.first_layer(layers);
    let arch = params.arch;
    // The modules the factors adapt, each once (a fused module under its first part).
    let targets: Vec<Target> = Target::EVERY
        .into_iter()
        .filter(|&t| params.iter().any(|(_, pt, _)| pt == t))
        .collect();
    let layers_to_transform: Value = if first == 0 {
        Value::Null
    } else {
        json!((first..layers).collect::<Vec<_>>())
    };
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha(),
        "lora_dropout": lora.dropout,
        "target_modules": targets.iter().map(|&t| peft_name_of(t, arch)).collect::<Vec<_>>(),
        "use_rslora": lora.rs_lora,
        "use_dora": false,
        "bias": "none",
        "fan_in_fan_out": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "layers_to_transform": layers_to_transform,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": null,
        "fine_tune_type": "lora",
        "num_layers": layers - first,
        "lora_parameters": {
            "rank": lora.rank,
            "scale": lora.multiplier(),
            "dropout": lora.dropout,
            "keys": targets.iter().map(|&t| t.hf_module_of(arch)).collect::<Vec<_>>(),
        },
    })
}

/// Writes a mountable adapter (PEFT and mlx-lm weights, one config) into `dir`
/// (created if needed).
pub fn save_adapter(
    dir: &Path,
    params: &LoraParams,
    lora: &LoraConfig,
    layers: usize,
    base_model: &str,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let weights = safetensors_bytes(&factor_tensors(params, ""));
    write_atomic(&dir.join(WEIGHTS_FILE), &weights)?;
    let weights = safetensors_bytes(&mlx_tensors(params));
    write_atomic(&dir.join(MLX_WEIGHTS_FILE), &weights)?;
    let config = serde_json::to_string_pretty(&peft_config(lora, params, layers, base_model))
        .unwrap_or_default();
    write_atomic(&dir.join(CONFIG_FILE), config.as_bytes())
}

/// What a checkpoint records besides the factors.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerState {
    /// Optimizer steps taken.
    pub step: u64,
    /// The LoRA layout it was trained with.
    pub lora: LoraConfig,
    /// The run's seed.
    pub seed: u64,
    /// The method's name.
    pub method: String,
}

/// Writes a checkpoint: the adapter, the optimizer moments, the step. The directory is
/// built under a temporary name and renamed into place.
pub fn save_checkpoint(
    dir: &Path,
    params: &LoraParams,
    opt: &AdamW,
    state: &TrainerState,
    layers: usize,
    base_model: &str,
) -> Result<()> {
    let tmp = dir.with_extension(format!("tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    save_adapter(&tmp, params, &state.lora, layers, base_model)?;
    let mut moments = factor_tensors(&opt.m, "m.");
    moments.extend(factor_tensors(&opt.v, "v."));
    write_atomic(&tmp.join(OPTIMIZER_FILE), &safetensors_bytes(&moments))?;
    let st = json!({
        "step": state.step,
        "adam_step": opt.step,
        "seed": state.seed,
        "method": state.method,
        "rank": state.lora.rank,
        "scale": state.lora.scale,
        "rs_lora": state.lora.rs_lora,
        "target_modules": state.lora.targets.iter().map(|&t| peft_name(t)).collect::<Vec<_>>(),
        "num_layers": state.lora.num_layers,
        "lora_dropout": state.lora.dropout,
    });
    write_atomic(&tmp.join(STATE_FILE), st.to_string().as_bytes())?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io(dir))?;
    }
    std::fs::rename(&tmp, dir).map_err(io(dir))
}

/// Reads the f32 tensors of a safetensors file by name.
/// Tensors by name: shape and f32 values.
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn read_tensors(file: &Path) -> Result<Tensors> {
    let st = SafetensorsWeights::open_files(file, &[file.to_path_buf()])?;
    let mut out = BTreeMap::new();
    for name in st.names() {
        let Some(w) = st.raw(name) else { continue };
        if w.dtype != GgmlType::F32 {
            let values = w.dequantize()?;
            out.insert(name.to_string(), (w.shape.clone(), values));
            continue;
        }
        let values = w
            .bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.insert(name.to_string(), (w.shape.clone(), values));
    }
    Ok(out)
}

fn fill(dst: &mut LoraParams, tensors: &Tensors, prefix: &str, path: &Path) -> Result<()> {
    let bad = |reason: String| TrainError::Resume {
        path: path.to_path_buf(),
        reason,
    };
    let (rank, arch) = (dst.rank, dst.arch);
    for (l, slots) in dst.layers.iter_mut().enumerate() {
        for (i, slot) in slots.iter_mut().enumerate() {
            let Some(p) = slot else { continue };
            let t = Target::EVERY[i];
            for (factor, values, shape) in [
                ("A", &mut p.a, vec![rank, p.in_dim]),
                ("B", &mut p.b, vec![p.out_dim, rank]),
            ] {
                let key = format!("{prefix}{}", peft_key(arch, l, t, factor));
                let (s, v) = tensors
                    .get(&key)
                    .ok_or_else(|| bad(format!("no tensor {key}")))?;
                if *s != shape {
                    return Err(bad(format!(
                        "{key} has shape {s:?}, this run needs {shape:?}"
                    )));
                }
                values.copy_from_slice(v);
            }
        }
    }
    Ok(())
}

/// Factors shaped like `like` from a safetensors file of PEFT-named tensors, each name
/// preceded by `prefix` (`""` for an adapter's own file).
pub fn load_factors(file: &Path, like: &LoraParams, prefix: &str) -> Result<LoraParams> {
    let mut params = like.zeros_like();
    fill(&mut params, &read_tensors(file)?, prefix, file)?;
    Ok(params)
}

/// A checkpoint read back: factors, optimizer moments and step.
#[derive(Debug)]
pub struct Checkpoint {
    /// The factors.
    pub params: LoraParams,
    /// First and second moments.
    pub m: LoraParams,
    /// Second moments.
    pub v: LoraParams,
    /// Optimizer steps taken.
    pub step: u64,
    /// AdamW's own step count.
    pub adam_step: u64,
}

/// Reads the checkpoint in `dir` into buffers shaped like `like` (the run's layout),
/// refusing one trained with another rank, targets or layers.
pub fn load_checkpoint(dir: &Path, like: &LoraParams, lora: &LoraConfig) -> Result<Checkpoint> {
    let bad = |reason: String| TrainError::Resume {
        path: dir.to_path_buf(),
        reason,
    };
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).map_err(io(&state_path))?;
    let st: Value = serde_json::from_str(&text).map_err(|e| bad(format!("{STATE_FILE}: {e}")))?;
    let num = |k: &str| st.get(k).and_then(Value::as_u64);
    if num("rank") != Some(lora.rank as u64) {
        return Err(bad(format!(
            "it was trained with rank {:?}, this run asks for {}",
            num("rank"),
            lora.rank
        )));
    }
    let targets: Vec<&str> = lora.targets.iter().map(|&t| peft_name(t)).collect();
    if st.get("target_modules") != Some(&json!(targets)) {
        return Err(bad("its target modules differ from this run's".into()));
    }
    let mut params = like.zeros_like();
    let weights = read_tensors(&dir.join(WEIGHTS_FILE))?;
    fill(&mut params, &weights, "", dir)?;
    let moments = read_tensors(&dir.join(OPTIMIZER_FILE))?;
    let (mut m, mut v) = (like.zeros_like(), like.zeros_like());
    fill(&mut m, &moments, "m.", dir)?;
    fill(&mut v, &moments, "v.", dir)?;
    Ok(Checkpoint {
        params,
        m,
        v,
        step: num("step").ok_or_else(|| bad("no step".into()))?,
        adam_step: num("adam_step").unwrap_or(0),
    })
}

/// The newest checkpoint under `dir/checkpoints`, or `dir` itself when it is one.
pub fn latest_checkpoint(dir: &Path) -> Option<PathBuf> {
    if dir.join(STATE_FILE).is_file() {
        return Some(dir.to_path_buf());
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir.join("checkpoints"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join(STATE_FILE).is_file())
        .collect();
    found.sort();
    found.pop()
}
