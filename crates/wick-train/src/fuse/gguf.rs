//! Fusing into a GGUF file: the same metadata (tokenizer and chat template included) and
//! tensor order; each changed matrix dequantized, fused and written in its float type, or
//! as F16 when the base quantized it.
//!
//! GGUF Llama files hold Q/K rows permuted for interleaved rotary pairs; the adapter is
//! read with the same permutation the server mounts it with, so `B·A` lands in the
//! file's row order.
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::BufWriter;
use std::path::Path;

use wick_engine::adapters::load::QkPermutation;
use wick_engine::adapters::load_host;
use wick_engine::backend::RopeStyle;
use wick_engine::config::ModelConfig;
use wick_engine::weights::HostWeight;
use wick_engine::EngineError;
use wick_gguf::{GgmlType, GgufFile, GgufWriter};

use super::{add_delta, site, FusedDtype, Written};
use crate::error::{io, Result, TrainError};
use wick_engine::weights::affine::float_bytes;

/// The type a changed matrix is written in: its own when it is a float, else F16.
fn fused_type(t: GgmlType) -> GgmlType {
    match t {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => t,
        _ => GgmlType::F16,
    }
}

pub(super) fn fuse_file(base: &Path, adapter: &Path, tmp: &Path) -> Result<Written> {
    let file = GgufFile::open(base).map_err(EngineError::from)?;
    let cfg = ModelConfig::from_gguf(file.metadata(), &base.display().to_string())?;
    let permute = (cfg.rope_style == RopeStyle::Interleaved).then_some(QkPermutation {
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
    });
    let host = load_host(adapter, &cfg, permute)?;
    if !host.expert_deltas.is_empty() {
        return Err(TrainError::Config(format!(
            "{}: fusing adapters of the mixture-of-experts weights into the base is not supported",
            adapter.display()
        )));
    }
    // Tensor name → its deltas and their first rows, every shape checked before anything
    // is written.
    let mut changes: HashMap<String, Vec<(usize, usize)>> = HashMap::new();
    let mut first_type = None;
    for (i, d) in host.deltas.iter().enumerate() {
        let at = site(d, base, |name| {
            Ok(file
                .tensors()
                .iter()
                .find(|t| t.name == name)
                .and_then(|t| t.shape().try_into().ok()))
        })?;
        if let Some(t) = file.tensors().iter().find(|t| t.name == at.tensor) {
            first_type.get_or_insert(t.dtype);
        }
        changes.entry(at.tensor).or_default().push((i, at.row));
    }
    let mut writer = GgufWriter::new();
    for (key, value) in file.metadata().entries() {
        writer.metadata(key.clone(), value.clone());
    }
    for t in file.tensors() {
        match changes.get(&t.name) {
            Some(_) => {
                let to = fused_type(t.dtype);
                let len = t.elements() as usize * if to == GgmlType::F32 { 4 } else { 2 };
                writer.tensor_of_len(t.name.clone(), t.dims.clone(), to, len)
            }
            None => writer.tensor_of_len(t.name.clone(), t.dims.clone(), t.dtype, t.len as usize),
        };
    }
    std::fs::create_dir_all(tmp).map_err(io(tmp))?;
    let stem = base
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let name = format!("{stem}-fused.gguf");
    let out = tmp.join(&name);
    let mut w = BufWriter::with_capacity(1 << 20, std::fs::File::create(&out).map_err(io(&out))?);
    let fused = |t: &wick_gguf::TensorInfo, deltas: &[(usize, usize)]| -> Result<Vec<u8>> {
        let view = file.tensor(&t.name).map_err(EngineError::from)?;
        let weight = HostWeight {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape(),
            bytes: Cow::Borrowed(view.data),
        };
        let mut values = weight.dequantize()?;
        for &(d, row) in deltas {
            add_delta(&mut values, &host.deltas[d], row)?;
        }
        Ok(float_bytes(&values, fused_type(t.dtype)))
    };
    let tensors = file.tensors();
    writer
        .write_streaming(&mut w, |i| {
            let t = &tensors[i];
            match changes.get(&t.name) {
                Some(deltas) => fused(t, deltas)
                    .map(Cow::Owned)
                    .map_err(std::io::Error::other),
                None => file
                    .tensor(&t.name)
                    .map(|v| Cow::Borrowed(v.data))
                    .map_err(std::io::Error::other),
            }
        })
        .map_err(|e| match e.downcast::<TrainError>() {
            Ok(inner) => inner,
            Err(e) => io(&out)(e),
        })?;
    let f = w.into_inner().map_err(|e| io(&out)(e.into_error()))?;
    f.sync_all().map_err(io(&out))?;
    let from = first_type.unwrap_or(GgmlType::F32);
    let to = fused_type(from);
    Ok(Written {
        model_file: Some(name),
        adapter_format: host.format,
        dtype: if from == to {
            FusedDtype::Float(to)
        } else {
            FusedDtype::Dequantized { from, to }
        },
        modules: changes.len(),
    })
}
