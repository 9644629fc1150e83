//! Fusing into a Hugging Face folder: the same shards, tensor names, shapes and dtypes
//! (so `model.safetensors.index.json` still holds), only the bytes of the changed
//! projections new.
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use wick_engine::adapters::{load_host, HostAdapter};
use wick_engine::config::ModelConfig;
use wick_engine::weights::{AffineWeight, MlxQuantization, SafetensorsWeights, WeightSource};
use wick_gguf::GgmlType;

use super::{add_delta, refuse, site, FusedDtype, Written};
use crate::error::{io, Result, TrainError};
use wick_engine::weights::affine::float_bytes;

const INDEX_FILE: &str = "model.safetensors.index.json";

/// How one changed projection is stored in the base.
enum Stored {
    Float(GgmlType),
    Affine {
        bits: u32,
        group_size: usize,
        side: GgmlType,
    },
}

/// One matrix to rewrite: its tensor (or, quantized, its module's three tensors) and the
/// deltas to add (one, or one per part of a fused module).
struct Change {
    /// The weight tensor's name in the files.
    tensor: String,
    /// Its canonical name (`blk.3.attn_q.weight`).
    canonical: String,
    /// The module path (`model.layers.3.self_attn.q_proj`): the affine side tensors'
    /// prefix.
    module: String,
    stored: Stored,
    /// Each delta and the first row it adds to.
    deltas: Vec<(usize, usize)>,
}

pub(super) fn fuse_folder(base: &Path, adapter: &Path, tmp: &Path) -> Result<Written> {
    let cfg_path = base.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| refuse(&cfg_path, format!("not valid JSON: {e}")))?;
    let source = cfg_path.display().to_string();
    let cfg = ModelConfig::from_hf(&json, &source)?;
    let quant = MlxQuantization::from_config(&json, &source)?;
    let host = load_host(adapter, &cfg, None)?;
    if !host.expert_deltas.is_empty() {
        return Err(TrainError::Config(format!(
            "{}: fusing adapters of the mixture-of-experts weights into the base is not supported",
            adapter.display()
        )));
    }
    let weights = SafetensorsWeights::open(base)?;
    let named = weights
        .canonical_as(cfg.features.hf_naming)
        .with_quantization(quant);
    let changes = plan(&named, &host, base)?;
    // Every tensor a change rewrites: the weight, and a quantized module's side tensors.
    let mut rewritten: HashMap<String, usize> = HashMap::new();
    for (i, c) in changes.iter().enumerate() {
        rewritten.insert(c.tensor.clone(), i);
        if matches!(c.stored, Stored::Affine { .. }) {
            for side in ["scales", "biases"] {
                rewritten.insert(format!("{}.{side}", c.module), i);
            }
        }
    }
    std::fs::create_dir_all(tmp).map_err(io(tmp))?;
    let mut fuser = Fuser {
        named: &named,
        host: &host,
        changes: &changes,
        affine_done: HashMap::new(),
    };
    for shard in shards(base)? {
        write_shard(&shard, tmp, &rewritten, &mut fuser)?;
    }
    copy_other_files(base, tmp)?;
    let dtype = match changes.first().map(|c| &c.stored) {
        Some(Stored::Affine {
            bits, group_size, ..
        }) => FusedDtype::MlxAffine {
            bits: *bits,
            group_size: *group_size,
        },
        Some(Stored::Float(t)) => FusedDtype::Float(*t),
        None => FusedDtype::Float(GgmlType::F32),
    };
    Ok(Written {
        model_file: None,
        adapter_format: host.format,
        dtype,
        modules: changes.len(),
    })
}

/// Writes `shard` into `out_dir` under its own name: the same tensors in the same dtypes and
/// shapes, the ones in `rewritten` fused.
fn write_shard(
    shard: &Path,
    out_dir: &Path,
    rewritten: &HashMap<String, usize>,
    fuser: &mut Fuser<'_>,
) -> Result<()> {
    let file_name = shard.file_name().unwrap_or_default().to_owned();
    let src = SafetensorsWeights::open_files(shard, &[shard.to_path_buf()])?;
    let mut names: Vec<&str> = src.names().collect();
    names.sort_unstable();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let (dtype, shape, bytes) = if let Some(w) = src.raw(name) {
            (dtype_name(w.dtype), w.shape.clone(), w.bytes)
        } else if let Some((bytes, shape)) = src.packed(name) {
            ("U32", shape.to_vec(), Cow::Borrowed(bytes))
        } else {
            return Err(refuse(
                shard,
                format!("tensor {name} is an integer buffer, which fuse cannot copy"),
            ));
        };
        let change = rewritten.get(name).copied();
        tensors.push((name, dtype, shape, bytes, change));
    }
    let out = out_dir.join(&file_name);
    let file = std::fs::File::create(&out).map_err(io(&out))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, dtype, shape, bytes, _) in &tensors {
        let end = offset + bytes.len();
        header.insert(
            name.to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut head = Value::Object(header).to_string().into_bytes();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    w.write_all(&(head.len() as u64).to_le_bytes())
        .and_then(|()| w.write_all(&head))
        .map_err(io(&out))?;
    for (name, _, _, bytes, change) in &tensors {
        let fused;
        let data: &[u8] = match change {
            Some(i) => {
                fused = fuser.bytes(*i, name)?;
                if fused.len() != bytes.len() {
                    return Err(refuse(
                        shard,
                        format!(
                            "fused {name} came out at {} bytes, not {}",
                            fused.len(),
                            bytes.len()
                        ),
                    ));
                }
                &fused
            }
            None => bytes,
        };
        w.write_all(data).map_err(io(&out))?;
    }
    let file = w.into_inner().map_err(|e| io(&out)(e.into_error()))?;
    file.sync_all().map_err(io(&out))?;
    Ok(())
}

/// Finds each delta's tensor and checks its shape, before anything is allocated or written.
fn plan(named: &dyn WeightSource, host: &HostAdapter, base: &Path) -> Result<Vec<Change>> {
    let mut changes: Vec<Change> = Vec::with_capacity(host.deltas.len());
    for (i, d) in host.deltas.iter().enumerate() {
        let at = site(d, base, |name| {
            Ok(match named.affine(name)? {
                Some(a) => Some([a.rows, a.cols]),
                None => named.get(name)?.and_then(|w| w.shape.try_into().ok()),
            })
        })?;
        if let Some(c) = changes.iter_mut().find(|c| c.canonical == at.tensor) {
            c.deltas.push((i, at.row));
            continue;
        }
        let module_of = |name: &str| name.strip_suffix(".weight").unwrap_or(name).to_string();
        let change = if let Some(a) = named.affine(&at.tensor)? {
            Change {
                tensor: a.name.clone(),
                canonical: at.tensor,
                module: module_of(&a.name),
                stored: Stored::Affine {
                    bits: a.bits,
                    group_size: a.group_size,
                    side: a.scales.dtype,
                },
                deltas: vec![(i, at.row)],
            }
        } else if let Some(w) = named.get(&at.tensor)? {
            Change {
                tensor: w.name.clone(),
                canonical: at.tensor,
                module: module_of(&w.name),
                stored: Stored::Float(w.dtype),
                deltas: vec![(i, at.row)],
            }
        } else {
            return Err(refuse(base, format!("{} left the base", at.tensor)));
        };
        changes.push(change);
    }
    Ok(changes)
}

/// Computes the fused bytes of changed tensors, one projection at a time.
struct Fuser<'a> {
    named: &'a dyn WeightSource,
    host: &'a HostAdapter,
    changes: &'a [Change],
    /// Re-quantized modules whose side tensors are not written yet: `name → bytes`.
    affine_done: HashMap<String, Vec<u8>>,
}

impl Fuser<'_> {
    fn bytes(&mut self, i: usize, name: &str) -> Result<Vec<u8>> {
        if let Some(b) = self.affine_done.remove(name) {
            return Ok(b);
        }
        let c = &self.changes[i];
        let add = |values: &mut [f32]| {
            c.deltas
                .iter()
                .try_for_each(|&(d, row)| add_delta(values, &self.host.deltas[d], row))
        };
        match c.stored {
            Stored::Float(dtype) => {
                let w = self
                    .named
                    .get(&c.canonical)?
                    .ok_or_else(|| refuse(Path::new(name), "left the base while fusing"))?;
                let mut values = w.dequantize()?;
                add(&mut values)?;
                Ok(float_bytes(&values, dtype))
            }
            Stored::Affine {
                bits,
                group_size,
                side,
            } => {
                let a = self
                    .named
                    .affine(&c.canonical)?
                    .ok_or_else(|| refuse(Path::new(name), "left the base while fusing"))?;
                let mut values = a.dequantize()?;
                add(&mut values)?;
                let q = AffineWeight::quantize(
                    &a.name,
                    &values,
                    (a.rows, a.cols),
                    (bits, group_size),
                    side,
                )?;
                let mut parts = HashMap::from([
                    (c.tensor.clone(), q.packed.into_owned()),
                    (format!("{}.scales", c.module), q.scales.bytes.into_owned()),
                    (format!("{}.biases", c.module), q.biases.bytes.into_owned()),
                ]);
                let mine = parts.remove(name).unwrap_or_default();
                self.affine_done.extend(parts);
                Ok(mine)
            }
        }
    }
}

/// The safetensors files of the folder, as the engine finds them: the shards the index
/// names, else every `*.safetensors` file.
fn shards(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    let mut files: Vec<PathBuf> = if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(io(&index))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| refuse(&index, format!("not valid JSON: {e}")))?;
        json.get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| refuse(&index, "no weight_map"))?
            .values()
            .filter_map(Value::as_str)
            .map(|f| dir.join(f))
            .collect()
    } else {
        std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect()
    };
    files.sort();
    files.dedup();
    Ok(files)
}

/// Copies the folder's other top-level files (config, tokenizer, generation config, chat
/// template, the shard index); hidden files and subfolders stay behind.
fn copy_other_files(base: &Path, out: &Path) -> Result<()> {
    for entry in std::fs::read_dir(base).map_err(io(base))? {
        let entry = entry.map_err(io(base))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let is_weights = name.ends_with(".safetensors");
        // `metadata` follows links: Hugging Face snapshots link into `blobs/`.
        let is_file = std::fs::metadata(&path).is_ok_and(|m| m.is_file());
        if name.starts_with('.') || is_weights || !is_file {
            continue;
        }
        let dst = out.join(&name);
        std::fs::copy(&path, &dst).map_err(io(&dst))?;
    }
    Ok(())
}

fn dtype_name(t: GgmlType) -> &'static str {
    match t {
        GgmlType::F16 => "F16",
        GgmlType::Bf16 => "BF16",
        _ => "F32",
    }
}
