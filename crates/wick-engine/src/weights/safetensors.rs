//! Weights from (possibly sharded) Hugging Face `*.safetensors` files, including
//! MLX-quantized checkpoints (mlx-community layout: U32 packed `.weight` with `.scales`
//! and `.biases`, described by `config.json`'s `quantization`).
use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use wick_gguf::GgmlType;

use super::HostWeight;
use super::{AffineWeight, WeightSource};
use crate::config::HfNaming;
use crate::{EngineError, Result};

/// How a tensor's elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    /// A float type.
    Float(GgmlType),
    /// Packed quantized words (MLX affine layout).
    U32,
    /// Integers no weight is made of (BERT's `position_ids` buffer): kept out of the
    /// weights, `size` bytes each.
    Integer(usize),
}

struct Entry {
    file: usize,
    dtype: Stored,
    shape: Vec<usize>,
    range: (usize, usize),
}

/// All tensors of a model directory, memory-mapped.
pub struct SafetensorsWeights {
    dir: PathBuf,
    maps: Vec<Mmap>,
    entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for SafetensorsWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsWeights")
            .field("dir", &self.dir)
            .field("tensors", &self.entries.len())
            .finish()
    }
}

impl SafetensorsWeights {
    /// Maps the model's `*.safetensors` files in `dir`: the shards a
    /// `model.safetensors.index.json` names, else every `*.safetensors` file.
    pub fn open(dir: &Path) -> Result<Self> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| EngineError::Io { path, source }
        };
        let index = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(io(&index))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| bad(&index, format!("not JSON: {e}")))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| bad(&index, "no weight_map"))?;
            let mut shards: Vec<PathBuf> = map
                .values()
                .filter_map(|v| v.as_str())
                .map(|f| dir.join(f))
                .collect();
            shards.dedup();
            shards
        } else {
            std::fs::read_dir(dir)
                .map_err(io(dir))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect()
        };
        files.sort();
        files.dedup();
        if files.is_empty() {
            return Err(EngineError::Config {
                source_name: dir.display().to_string(),
                reason: "no *.safetensors files in the model directory".into(),
            });
        }
        Self::open_files(dir, &files)
    }

    /// Maps exactly `files` (described as `name` in errors).
    pub fn open_files(name: &Path, files: &[PathBuf]) -> Result<Self> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| EngineError::Io { path, source }
        };
        let mut maps = Vec::new();
        let mut entries = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            // A FIFO would block the open; a device or directory is no weights file.
            if !super::check_regular_file(path)? {
                return Err(EngineError::Io {
                    path: path.to_path_buf(),
                    source: std::io::ErrorKind::NotFound.into(),
                });
            }
            let file = File::open(path).map_err(io(path))?;
            // SAFETY: read-only mapping of a model file wick does not modify.
            let map = unsafe { Mmap::map(&file) }.map_err(io(path))?;
            for (name, entry) in parse_header(path, &map, i)? {
                entries.insert(name, entry);
            }
            maps.push(map);
        }
        Ok(SafetensorsWeights {
            dir: name.to_path_buf(),
            maps,
            entries,
        })
    }

    /// Names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The raw (Hugging Face) float tensor `name` (`None` for packed U32 tensors too:
    /// see [`SafetensorsWeights::packed`]).
    pub fn raw(&self, name: &str) -> Option<HostWeight<'_>> {
        let e = self.entries.get(name)?;
        let Stored::Float(dtype) = e.dtype else {
            return None;
        };
        Some(HostWeight {
            name: name.to_string(),
            dtype,
            shape: e.shape.clone(),
            bytes: Cow::Borrowed(&self.maps[e.file][e.range.0..e.range.1]),
        })
    }

    /// The bytes and shape of the packed U32 tensor `name`.
    pub fn packed(&self, name: &str) -> Option<(&[u8], &[usize])> {
        let e = self.entries.get(name)?;
        (e.dtype == Stored::U32).then(|| (&self.maps[e.file][e.range.0..e.range.1], &e.shape[..]))
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> EngineError {
    EngineError::Safetensors {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn parse_header(path: &Path, map: &[u8], file: usize) -> Result<Vec<(String, Entry)>> {
    if map.len() < 8 {
        return Err(bad(path, "shorter than its 8-byte header length"));
    }
    let n = u64::from_le_bytes(map[..8].try_into().unwrap_or_default());
    let header_end = 8u64
        .checked_add(n)
        .filter(|&e| e <= map.len() as u64)
        .ok_or_else(|| {
            bad(
                path,
                format!(
                    "header length {n} runs past the end of the file ({} bytes)",
                    map.len()
                ),
            )
        })? as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&map[8..header_end])
            .map_err(|e| bad(path, format!("header is not JSON: {e}")))?;
    let data_len = map.len() - header_end;
    let mut out = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = match info.get("dtype").and_then(|d| d.as_str()) {
            Some("F32") => Stored::Float(GgmlType::F32),
            Some("F16") => Stored::Float(GgmlType::F16),
            Some("BF16") => Stored::Float(GgmlType::Bf16),
            Some("U32") => Stored::U32,
            Some("I64" | "U64") => Stored::Integer(8),
            Some("I32") => Stored::Integer(4),
            Some("I16" | "U16") => Stored::Integer(2),
            Some("I8" | "U8" | "BOOL") => Stored::Integer(1),
            Some(other) => {
                return Err(EngineError::UnsupportedDtype {
                    source_name: path.display().to_string(),
                    tensor: name,
                    dtype: other.to_string(),
                })
            }
            None => return Err(bad(path, format!("tensor '{name}' has no dtype"))),
        };
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .ok_or_else(|| bad(path, format!("tensor '{name}' has no valid shape")))?;
        let offsets: Vec<usize> = info
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .ok_or_else(|| bad(path, format!("tensor '{name}' has no valid data_offsets")))?;
        let [start, end] = offsets[..] else {
            return Err(bad(
                path,
                format!("tensor '{name}' data_offsets must be two numbers"),
            ));
        };
        let elem_size = match dtype {
            Stored::Float(GgmlType::F32) | Stored::U32 => 4,
            Stored::Float(_) => 2,
            Stored::Integer(size) => size,
        };
        let bytes = shape
            .iter()
            .try_fold(elem_size, |n: usize, &d| n.checked_mul(d))
            .ok_or_else(|| bad(path, format!("tensor '{name}' shape {shape:?} overflows")))?;
        if start > end || end > data_len || end - start != bytes {
            return Err(bad(
                path,
                format!("tensor '{name}' bytes {start}..{end} do not match shape {shape:?} or the file size (truncated?)"),
            ));
        }
        out.push((
            name,
            Entry {
                file,
                dtype,
                shape,
                range: (header_end + start, header_end + end),
            },
        ));
    }
    // Two tensors sharing bytes: a damaged or crafted header (as the safetensors format forbids).
    let mut ranges: Vec<(usize, usize, &str)> = out
        .iter()
        .filter(|(_, e)| e.range.1 > e.range.0)
        .map(|(n, e)| (e.range.0, e.range.1, n.as_str()))
        .collect();
    ranges.sort_unstable();
    if let Some(pair) = ranges.windows(2).find(|p| p[0].1 > p[1].0) {
        return Err(bad(
            path,
            format!("tensor '{}' overlaps tensor '{}'", pair[0].2, pair[1].2),
        ));
    }
    Ok(out)
}

/// Hugging Face name of a canonical (llama.cpp-style) tensor name.
fn hf_name(canonical: &str) -> Option<String> {
    // Qwen 3.5's linear-attention (gated DeltaNet) tensors keep their Hugging Face names
    // (`A_log` and `dt_bias` have no `.weight` suffix).
    if let Some((layer, part)) = canonical
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once(".linear_attn."))
    {
        return Some(format!("model.layers.{layer}.linear_attn.{part}"));
    }
    let name = canonical
        .strip_suffix(".weight")
        .map(|n| (n, "weight"))
        .or_else(|| canonical.strip_suffix(".bias").map(|n| (n, "bias")))?;
    let (base, kind) = name;
    let mapped = match base {
        "token_embd" => "model.embed_tokens".to_string(),
        "output_norm" => "model.norm".to_string(),
        "output" => "lm_head".to_string(),
        _ => {
            let rest = base.strip_prefix("blk.")?;
            let (layer, part) = rest.split_once('.')?;
            let module = match part {
                "attn_norm" => "input_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                // Llama/Qwen call the pre-MLP norm post_attention_layernorm; Gemma's
                // sandwich layout names it pre_feedforward_layernorm (see `hf_name_gemma`).
                "ffn_norm" => "post_attention_layernorm",
                "post_attention_norm" => "post_attention_layernorm",
                "post_ffw_norm" => "post_feedforward_layernorm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                // Stored fused (Phi-3, GLM-4).
                "attn_qkv" => "self_attn.qkv_proj",
                "ffn_gate_up" => "mlp.gate_up_proj",
                _ => return None,
            };
            format!("model.layers.{layer}.{module}")
        }
    };
    Some(format!("{mapped}.{kind}"))
}

/// Gemma's sandwich norms: `ffn_norm` is `pre_feedforward_layernorm`.
fn hf_name_gemma(canonical: &str) -> Option<String> {
    if let Some(rest) = canonical.strip_prefix("blk.") {
        if let Some((layer, "ffn_norm.weight")) = rest.split_once('.') {
            return Some(format!(
                "model.layers.{layer}.pre_feedforward_layernorm.weight"
            ));
        }
    }
    hf_name_gemma4(canonical).or_else(|| hf_name(canonical))
}

/// Gemma 4's own tensors (per-layer inputs, layer scalars, experts) under llama.cpp's
/// `gemma4` names.
fn hf_name_gemma4(canonical: &str) -> Option<String> {
    let global = match canonical {
        "per_layer_token_embd.weight" => Some("model.embed_tokens_per_layer.weight"),
        "per_layer_model_proj.weight" => Some("model.per_layer_model_projection.weight"),
        "per_layer_proj_norm.weight" => Some("model.per_layer_projection_norm.weight"),
        _ => None,
    };
    if let Some(name) = global {
        return Some(name.to_string());
    }
    let (layer, part) = canonical.strip_prefix("blk.")?.split_once('.')?;
    let module = match part {
        "inp_gate.weight" => "per_layer_input_gate.weight",
        "proj.weight" => "per_layer_projection.weight",
        "post_norm.weight" => "post_per_layer_input_norm.weight",
        "layer_output_scale.weight" => "layer_scalar",
        "post_ffw_norm_1.weight" => "post_feedforward_layernorm_1.weight",
        "pre_ffw_norm_2.weight" => "pre_feedforward_layernorm_2.weight",
        "post_ffw_norm_2.weight" => "post_feedforward_layernorm_2.weight",
        "ffn_gate_inp.weight" => "router.proj.weight",
        "ffn_gate_inp.scale" => "router.scale",
        "ffn_down_exps.scale" => "router.per_expert_scale",
        "ffn_gate_up_exps.weight" => "experts.gate_up_proj",
        "ffn_down_exps.weight" => "experts.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{module}"))
}

/// A family's own names for some canonical ones (see [`HfNaming`]).
fn hf_name_as(naming: HfNaming, canonical: &str) -> Option<String> {
    let renamed = |part: &str| -> Option<&'static str> {
        match (naming, part) {
            (HfNaming::Llama, _) => None,
            (HfNaming::Gemma, "ffn_norm.weight") => Some("pre_feedforward_layernorm.weight"),
            (HfNaming::Glm4, "post_attention_norm.weight") => {
                Some("post_self_attn_layernorm.weight")
            }
            (HfNaming::Glm4, "post_ffw_norm.weight") => Some("post_mlp_layernorm.weight"),
            (HfNaming::Starcoder2, "ffn_up.weight") => Some("mlp.c_fc.weight"),
            (HfNaming::Starcoder2, "ffn_up.bias") => Some("mlp.c_fc.bias"),
            (HfNaming::Starcoder2, "ffn_down.weight") => Some("mlp.c_proj.weight"),
            (HfNaming::Starcoder2, "ffn_down.bias") => Some("mlp.c_proj.bias"),
            _ => None,
        }
    };
    if let Some((layer, part)) = canonical
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
    {
        if let Some(name) = renamed(part) {
            return Some(format!("model.layers.{layer}.{name}"));
        }
    }
    hf_name(canonical)
}

/// A safetensors directory seen through canonical names.
#[derive(Debug)]
pub struct HfNamedWeights<'a> {
    pub(crate) inner: &'a SafetensorsWeights,
    pub(crate) naming: HfNaming,
    pub(crate) quantization: Option<MlxQuantization>,
}

impl SafetensorsWeights {
    /// This directory under canonical names; `gemma` selects the sandwich-norm naming.
    pub fn canonical(&self, gemma: bool) -> HfNamedWeights<'_> {
        self.canonical_as(if gemma {
            HfNaming::Gemma
        } else {
            HfNaming::Llama
        })
    }

    /// This directory under canonical names, read with a family's `naming`.
    pub fn canonical_as(&self, naming: HfNaming) -> HfNamedWeights<'_> {
        HfNamedWeights {
            inner: self,
            naming,
            quantization: None,
        }
    }
}

impl HfNamedWeights<'_> {
    /// Reads packed matrices with `q` (from `config.json`, see [`MlxQuantization`]).
    pub fn with_quantization(mut self, q: Option<MlxQuantization>) -> Self {
        self.quantization = q;
        self
    }
}

/// `(bits, group_size)` of one quantized module.
pub type AffineParams = (u32, usize);

/// `config.json`'s `quantization` (or `quantization_config`) of an MLX-quantized
/// checkpoint: defaults plus per-module overrides keyed by module path
/// (`model.layers.3.mlp.down_proj`, `lm_head` …), where `false` means "left unquantized".
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MlxQuantization {
    /// Default `(bits, group_size)`.
    pub default: AffineParams,
    /// Per-module values (`None`: not quantized).
    pub overrides: HashMap<String, Option<AffineParams>>,
}

impl MlxQuantization {
    /// Parses the quantization section of a Hugging Face `config.json`; `Ok(None)` when
    /// the model is not MLX-quantized. Non-affine modes (mxfp4 …) are refused.
    pub fn from_config(config: &serde_json::Value, source: &str) -> Result<Option<Self>> {
        let Some(q) = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"))
            .and_then(|q| q.as_object())
        else {
            return Ok(None);
        };
        let err = |reason: String| EngineError::Config {
            source_name: source.to_string(),
            reason,
        };
        // `bits`/`group_size` of a module; an override may leave either out or null
        // (mlx-lm's mixed recipes write `"group_size": null`), meaning the model's value.
        let params = |v: &serde_json::Map<String, serde_json::Value>,
                      what: &str,
                      inherit: Option<AffineParams>| {
            let field = |key: &str, inherited: Option<u64>| match v.get(key) {
                None | Some(serde_json::Value::Null) => inherited,
                Some(x) => x.as_u64(),
            };
            let bits = field("bits", inherit.map(|p| u64::from(p.0)));
            let gs = field("group_size", inherit.map(|p| p.1 as u64));
            match (bits, gs) {
                (Some(b), Some(g)) => Ok((b as u32, g as usize)),
                _ => Err(err(format!(
                    "quantization of {what} needs integer bits and group_size"
                ))),
            }
        };
        if let Some(mode) = q.get("mode").and_then(|m| m.as_str()) {
            if mode != "affine" {
                return Err(err(format!(
                    "quantization mode '{mode}' is not supported (only MLX affine)"
                )));
            }
        }
        if q.get("bits").is_none() && q.get("quant_method").is_some() {
            // A transformers quantization_config of another method (gptq, awq …).
            return Err(err(format!(
                "quantization method {} is not supported (only MLX affine)",
                q["quant_method"]
            )));
        }
        let default = params(q, "the model", None)?;
        let mut overrides = HashMap::new();
        for (k, v) in q {
            match v {
                serde_json::Value::Object(m) => {
                    overrides.insert(k.clone(), Some(params(m, k, Some(default))?));
                }
                serde_json::Value::Bool(false) => {
                    overrides.insert(k.clone(), None);
                }
                _ => {}
            }
        }
        Ok(Some(MlxQuantization { default, overrides }))
    }

    /// `(bits, group_size)` of module `path`, `None` when it is left unquantized.
    pub fn module(&self, path: &str) -> Option<AffineParams> {
        match self.overrides.get(path) {
            Some(p) => *p,
            None => Some(self.default),
        }
    }
}

impl HfNamedWeights<'_> {
    fn map(&self, canonical: &str) -> Option<String> {
        if let Some(raw) = canonical.strip_prefix(super::RAW_PREFIX) {
            // A tower's own tensors, by their Hugging Face names: at the top level as
            // transformers 5 saves them, or under `model.` (newer multimodal layouts); the
            // SigLIP of checkpoints saved by transformers 4 nests one `vision_model.` deeper.
            let nested = raw.replacen("vision_tower.", "vision_tower.vision_model.", 1);
            return [
                raw.to_string(),
                format!("model.{raw}"),
                nested.clone(),
                format!("model.{nested}"),
            ]
            .into_iter()
            .find(|n| self.inner.entries.contains_key(n));
        }
        let name = match self.naming {
            HfNaming::Gemma => hf_name_gemma(canonical),
            naming => hf_name_as(naming, canonical),
        }?;
        if self.inner.entries.contains_key(&name) {
            return Some(name);
        }
        // Some checkpoints (multimodal wrappers) nest the text model one level deeper.
        let nested = name.replacen("model.", "model.language_model.", 1);
        if self.inner.entries.contains_key(&nested) {
            return Some(nested);
        }
        // Older multimodal checkpoints (Gemma 3) keep the whole causal LM under
        // `language_model.`.
        let wrapped = format!("language_model.{name}");
        if self.inner.entries.contains_key(&wrapped) {
            return Some(wrapped);
        }
        // A bare decoder saved without its head (`Qwen3Model`, as sentence-transformers
        // saves embedding models) has no `model.` prefix.
        let bare = name.strip_prefix("model.")?;
        self.inner
            .entries
            .contains_key(bare)
            .then(|| bare.to_string())
    }
}

impl WeightSource for HfNamedWeights<'_> {
    fn source_name(&self) -> String {
        self.inner.dir.display().to_string()
    }

    fn get(&self, name: &str) -> Result<Option<HostWeight<'_>>> {
        let Some(hf) = self.map(name) else {
            return Ok(None);
        };
        if self.inner.packed(&hf).is_some() {
            return Err(EngineError::UnsupportedDtype {
                source_name: self.source_name(),
                tensor: hf,
                dtype: "U32 (packed; only matrices may be quantized)".into(),
            });
        }
        Ok(self.inner.raw(&hf))
    }

    fn affine(&self, name: &str) -> Result<Option<AffineWeight<'_>>> {
        let Some(hf) = self.map(name) else {
            return Ok(None);
        };
        let Some((packed, shape)) = self.inner.packed(&hf) else {
            return Ok(None);
        };
        let source = self.source_name();
        let module = hf.strip_suffix(".weight").unwrap_or(&hf);
        let Some(q) = &self.quantization else {
            return Err(EngineError::Config {
                source_name: source,
                reason: format!(
                    "'{hf}' is packed (U32) but config.json has no `quantization` section"
                ),
            });
        };
        let Some((bits, group_size)) = q.module(module) else {
            return Err(EngineError::Config {
                source_name: source,
                reason: format!("'{hf}' is packed but config.json says it is not quantized"),
            });
        };
        let side = |suffix: &str| {
            let n = format!("{module}.{suffix}");
            self.inner
                .raw(&n)
                .ok_or_else(|| EngineError::MissingTensor {
                    source_name: self.source_name(),
                    tensor: n,
                })
        };
        let [rows, words] = shape[..] else {
            return Err(EngineError::Config {
                source_name: source,
                reason: format!("packed '{hf}' is not 2-D: {shape:?}"),
            });
        };
        let w = AffineWeight {
            name: hf.clone(),
            rows,
            cols: words * 32 / bits.max(1) as usize,
            bits,
            group_size,
            packed: Cow::Borrowed(packed),
            scales: side("scales")?,
            biases: side("biases")?,
        };
        w.validate()?;
        Ok(Some(w))
    }

    fn contains(&self, name: &str) -> bool {
        self.map(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlx_quantization_config_with_overrides() {
        let cfg = serde_json::json!({
            "quantization": {"group_size": 64, "bits": 4,
                "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
                "model.layers.0.mlp.up_proj": {"group_size": null, "bits": 6, "mode": "affine"},
                "lm_head": false}
        });
        let q = MlxQuantization::from_config(&cfg, "c").unwrap().unwrap();
        assert_eq!(q.module("model.layers.1.self_attn.q_proj"), Some((4, 64)));
        assert_eq!(q.module("model.layers.0.mlp.down_proj"), Some((8, 32)));
        // A null group size is the model's.
        assert_eq!(q.module("model.layers.0.mlp.up_proj"), Some((6, 64)));
        let no_default = serde_json::json!({"quantization": {"group_size": null, "bits": 4}});
        assert!(MlxQuantization::from_config(&no_default, "c").is_err());
        assert_eq!(q.module("lm_head"), None);
        assert!(MlxQuantization::from_config(&serde_json::json!({}), "c")
            .unwrap()
            .is_none());
        let fp4 =
            serde_json::json!({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}});
        assert!(MlxQuantization::from_config(&fp4, "c")
            .unwrap_err()
            .to_string()
            .contains("mxfp4"));
    }

    #[test]
    fn integer_buffers_are_checked_and_kept_out_of_the_weights() {
        let path = Path::new("model.safetensors");
        // BERT checkpoints carry `embeddings.position_ids` as I64.
        let ok = file_bytes(
            serde_json::json!({
                "ids": {"dtype": "I64", "shape": [1, 3], "data_offsets": [0, 24]},
                "w": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]},
            }),
            32,
        );
        let entries = parse_header(path, &ok, 0).unwrap();
        assert_eq!(entries.len(), 2);
        let short = file_bytes(
            serde_json::json!({"ids": {"dtype": "I64", "shape": [1, 3], "data_offsets": [0, 12]}}),
            12,
        );
        assert!(parse_header(path, &short, 0).is_err(), "size not checked");
        let odd = file_bytes(
            serde_json::json!({"x": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}),
            1,
        );
        assert!(parse_header(path, &odd, 0).is_err());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        std::fs::write(&file, &ok).unwrap();
        let w = SafetensorsWeights::open_files(dir.path(), &[file]).unwrap();
        assert!(w.raw("ids").is_none());
        assert!(w.raw("w").is_some());
    }

    fn file_bytes(header: serde_json::Value, data_len: usize) -> Vec<u8> {
        let json = serde_json::to_vec(&header).unwrap();
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&json);
        bytes.resize(bytes.len() + data_len, 0);
        bytes
    }

    #[test]
    fn overlapping_and_overflowing_tensors_are_rejected() {
        let path = Path::new("model.safetensors");
        let ok = file_bytes(
            serde_json::json!({
                "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                "b": {"dtype": "F16", "shape": [4], "data_offsets": [16, 24]},
            }),
            24,
        );
        assert_eq!(parse_header(path, &ok, 0).unwrap().len(), 2);
        let overlap = file_bytes(
            serde_json::json!({
                "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                "b": {"dtype": "F16", "shape": [4], "data_offsets": [8, 16]},
            }),
            24,
        );
        let Err(err) = parse_header(path, &overlap, 0) else {
            panic!("overlapping tensors were accepted");
        };
        let msg = err.to_string();
        assert!(
            msg.contains("overlaps") && msg.contains("model.safetensors"),
            "{msg}"
        );
        // A shape whose product wraps around to the byte count must not pass.
        let wraps = file_bytes(
            serde_json::json!({
                "a": {"dtype": "F32", "shape": [4611686018427387904u64, 4, 1], "data_offsets": [0, 0]},
            }),
            0,
        );
        let Err(err) = parse_header(path, &wraps, 0) else {
            panic!("a wrapping shape was accepted");
        };
        let msg = err.to_string();
        assert!(msg.contains("overflows"), "{msg}");
    }

    #[test]
    fn multimodal_layouts_find_the_text_model_and_the_tower() {
        let dir = tempfile::tempdir().unwrap();
        let layouts = [
            [
                "language_model.model.norm.weight",
                "vision_tower.post_layernorm.weight",
            ],
            [
                "model.language_model.norm.weight",
                "model.vision_tower.post_layernorm.weight",
            ],
            [
                "language_model.model.norm.weight",
                "vision_tower.vision_model.post_layernorm.weight",
            ],
        ];
        for (i, [text, tower]) in layouts.into_iter().enumerate() {
            let file = dir.path().join(format!("{i}.safetensors"));
            let header = serde_json::json!({
                text: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                tower: {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            });
            std::fs::write(&file, file_bytes(header, 8)).unwrap();
            let w = SafetensorsWeights::open_files(dir.path(), &[file]).unwrap();
            let named = w.canonical(true);
            assert!(named.contains("output_norm.weight"), "{text}");
            let raw = format!(
                "{}vision_tower.post_layernorm.weight",
                super::super::RAW_PREFIX
            );
            assert!(named.contains(&raw), "{tower}");
        }
    }

    #[test]
    fn names_map_to_hugging_face() {
        assert_eq!(
            hf_name("token_embd.weight").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(
            hf_name("blk.3.attn_q.bias").as_deref(),
            Some("model.layers.3.self_attn.q_proj.bias")
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(
            hf_name_gemma("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            hf_name("blk.1.post_ffw_norm.weight").as_deref(),
            Some("model.layers.1.post_feedforward_layernorm.weight")
        );
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }
}
