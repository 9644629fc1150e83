//! Bringing host weights into MLX: float tensors in the compute dtype, MLX affine
//! matrices as they are, GGUF blocks re-laid out losslessly where they are affine groups
//! of 32, other GGUF types dequantized (each choice counted in the load report).
use wick_gguf::GgmlType;
use wick_mlx::{Array, Dtype, Quantized};

use super::{mlx_err, MlxBackend, MlxMatrix};
use crate::backend::candle::CandleBackend;
use crate::backend::{Backend, HostWeight};
use crate::weights::affine::from_gguf_blocks;
use crate::weights::AffineWeight;
use crate::{EngineError, Result};

fn dims(shape: &[usize]) -> Vec<i32> {
    shape.iter().map(|&d| d as i32).collect()
}

/// A float host weight as an evaluated array of the compute dtype.
pub(super) fn float(be: &MlxBackend, w: &HostWeight<'_>) -> Result<Array> {
    let dtype = match w.dtype {
        GgmlType::F32 => Dtype::F32,
        GgmlType::F16 => Dtype::F16,
        GgmlType::Bf16 => Dtype::BF16,
        other => {
            // Quantized 1-D weights do not occur; go through f32 for any that do.
            if other.block_len() > 1 {
                let values = dequantize_gguf(w)?;
                let a = Array::from_slice(&values, &dims(&w.shape)).map_err(mlx_err)?;
                return to_compute(be, a);
            }
            return Err(EngineError::UnsupportedDtype {
                source_name: "mlx backend".into(),
                tensor: w.name.clone(),
                dtype: other.to_string(),
            });
        }
    };
    let a = Array::from_bytes(&w.bytes, &dims(&w.shape), dtype).map_err(mlx_err)?;
    to_compute(be, a)
}

fn to_compute(be: &MlxBackend, a: Array) -> Result<Array> {
    let a = if a.dtype() == be.dtype() {
        a
    } else {
        be.stream().astype(&a, be.dtype()).map_err(mlx_err)?
    };
    wick_mlx::eval(&[&a]).map_err(mlx_err)?;
    Ok(a)
}

/// f32 values of a GGUF-quantized weight, dequantized by the CPU backend's kernels.
fn dequantize_gguf(w: &HostWeight<'_>) -> Result<Vec<f32>> {
    CandleBackend::cpu().floats(w)
}

/// A weight matrix from a file.
pub(super) fn matrix(be: &MlxBackend, w: HostWeight<'_>) -> Result<MlxMatrix> {
    if w.shape.len() != 2 {
        return Err(EngineError::Backend {
            backend: "mlx",
            message: format!("'{}' is not a matrix: shape {:?}", w.name, w.shape),
        });
    }
    match w.dtype {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
            be.note(format!("{} → dense {}", w.dtype, be.dtype()));
            Ok(MlxMatrix::Dense(float(be, &w)?))
        }
        dtype => {
            if let Some(a) = from_gguf_blocks(&w)? {
                return affine(be, a, Some(dtype));
            }
            be.note(format!("{dtype} → dequantized to dense {}", be.dtype()));
            let values = dequantize_gguf(&w)?;
            let a = Array::from_slice(&values, &dims(&w.shape)).map_err(mlx_err)?;
            Ok(MlxMatrix::Dense(to_compute(be, a)?))
        }
    }
}

/// An affine matrix (from an MLX checkpoint, or re-laid out from GGUF `origin`).
pub(super) fn affine(
    be: &MlxBackend,
    w: AffineWeight<'_>,
    origin: Option<GgmlType>,
) -> Result<MlxMatrix> {
    w.validate()?;
    let words = (w.cols * w.bits as usize / 32) as i32;
    let packed =
        Array::from_bytes(&w.packed, &[w.rows as i32, words], Dtype::U32).map_err(mlx_err)?;
    let rounded = w.scales.dtype == GgmlType::F32 && be.dtype() != Dtype::F32;
    be.note(format!(
        "{} → affine {}-bit group {} ({}{})",
        origin.map_or("MLX affine".to_string(), |t| t.to_string()),
        w.bits,
        w.group_size,
        if origin.is_some() {
            "re-laid out losslessly"
        } else {
            "as stored"
        },
        if rounded {
            format!(", scales rounded to {}", be.dtype())
        } else {
            String::new()
        }
    ));
    let q = Quantized {
        weight: packed,
        scales: float(be, &w.scales)?,
        biases: float(be, &w.biases)?,
        group_size: w.group_size as i32,
        bits: w.bits as i32,
    };
    wick_mlx::eval(&[&q.weight]).map_err(mlx_err)?;
    Ok(MlxMatrix::Affine {
        q,
        shape: (w.rows, w.cols),
    })
}

/// Whether `parts` can be stacked into one matrix: all dense, or all affine with the
/// same bits and group size.
pub(super) fn can_stack(parts: &[&MlxMatrix]) -> bool {
    match parts.first() {
        Some(MlxMatrix::Dense(first)) => parts.iter().all(|p| match p {
            MlxMatrix::Dense(a) => a.dtype() == first.dtype(),
            MlxMatrix::Affine { .. } => false,
        }),
        Some(MlxMatrix::Affine { q: first, .. }) => parts.iter().all(|p| match p {
            MlxMatrix::Affine { q, .. } => {
                q.bits == first.bits
                    && q.group_size == first.group_size
                    && q.scales.dtype() == first.scales.dtype()
            }
            MlxMatrix::Dense(_) => false,
        }),
        None => false,
    }
}

/// The rows of `parts` stacked (see [`can_stack`]), evaluated so the parts are freed.
pub(super) fn stack(be: &MlxBackend, parts: Vec<MlxMatrix>) -> Result<MlxMatrix> {
    let refs: Vec<&MlxMatrix> = parts.iter().collect();
    if !can_stack(&refs) {
        return Err(EngineError::Backend {
            backend: "mlx",
            message: "matrices of different layouts cannot be stacked".into(),
        });
    }
    let s = be.stream();
    let cat = |arrays: Vec<&Array>| s.concatenate(&arrays, 0).map_err(mlx_err);
    let out = match &parts[0] {
        MlxMatrix::Dense(_) => {
            let all: Vec<&Array> = parts
                .iter()
                .filter_map(|p| match p {
                    MlxMatrix::Dense(a) => Some(a),
                    MlxMatrix::Affine { .. } => None,
                })
                .collect();
            let a = cat(all)?;
            wick_mlx::eval(&[&a]).map_err(mlx_err)?;
            MlxMatrix::Dense(a)
        }
        MlxMatrix::Affine { q: first, shape } => {
            let qs: Vec<&Quantized> = parts
                .iter()
                .filter_map(|p| match p {
                    MlxMatrix::Affine { q, .. } => Some(q),
                    MlxMatrix::Dense(_) => None,
                })
                .collect();
            let rows: usize = parts.iter().map(|p| be.matrix_shape(p).0).sum();
            let q = Quantized {
                weight: cat(qs.iter().map(|q| &q.weight).collect())?,
                scales: cat(qs.iter().map(|q| &q.scales).collect())?,
                biases: cat(qs.iter().map(|q| &q.biases).collect())?,
                group_size: first.group_size,
                bits: first.bits,
            };
            wick_mlx::eval(&[&q.weight, &q.scales, &q.biases]).map_err(mlx_err)?;
            MlxMatrix::Affine {
                q,
                shape: (rows, shape.1),
            }
        }
    };
    Ok(out)
}
