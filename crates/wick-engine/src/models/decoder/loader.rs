//! [`Loader`]: reads a model's weights from its source onto the backend, checking each
//! tensor's shape and counting the bytes uploaded.
use std::borrow::Cow;

use wick_gguf::GgmlType;

use crate::backend::{Backend, HostWeight};
use crate::config::{ModelConfig, NormKind};
use crate::weights::WeightSource;
use crate::{EngineError, Result};

/// A norm's scale, and its bias where a LayerNorm has one.
pub(crate) struct Norm<B: Backend> {
    pub(crate) weight: B::Tensor,
    pub(crate) bias: Option<B::Tensor>,
}

impl<B: Backend> Norm<B> {
    /// `norm(x)` with the model's kind of norm.
    pub(crate) fn apply(&self, be: &B, cfg: &ModelConfig, x: &B::Tensor) -> Result<B::Tensor> {
        match cfg.features.norm {
            NormKind::Rms => be.rms_norm(x, &self.weight, cfg.rms_eps),
            NormKind::Layer => be.layer_norm(x, &self.weight, self.bias.as_ref(), cfg.rms_eps),
        }
    }
}

pub(crate) struct Loader<'a, B: Backend> {
    pub(crate) backend: &'a B,
    pub(crate) src: &'a dyn WeightSource,
    pub(crate) cfg: &'a ModelConfig,
    pub(crate) bytes: usize,
}

impl<B: Backend> Loader<'_, B> {
    pub(crate) fn required(&self, name: &str) -> Result<HostWeight<'_>> {
        self.src
            .get(name)?
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.src.source_name(),
                tensor: name.into(),
            })
    }

    pub(crate) fn check(&self, w: &HostWeight<'_>, expected: &[usize]) -> Result<()> {
        if w.shape != expected {
            return Err(EngineError::ShapeMismatch {
                source_name: self.src.source_name(),
                tensor: w.name.clone(),
                expected: expected.to_vec(),
                found: w.shape.clone(),
            });
        }
        Ok(())
    }

    pub(crate) fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Matrix> {
        if let Some(w) = self.src.affine(name)? {
            if [w.rows, w.cols] != [rows, cols] {
                return Err(EngineError::ShapeMismatch {
                    source_name: self.src.source_name(),
                    tensor: w.name.clone(),
                    expected: vec![rows, cols],
                    found: vec![w.rows, w.cols],
                });
            }
            let m = self.backend.affine_matrix(w)?;
            self.bytes += self.backend.matrix_bytes(&m);
            return Ok(m);
        }
        let w = self.required(name)?;
        self.check(&w, &[rows, cols])?;
        let m = self.backend.matrix(w)?;
        self.bytes += self.backend.matrix_bytes(&m);
        Ok(m)
    }

    /// The 1-D weight `name`, which must exist.
    pub(crate) fn required_vector(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        self.vector(name, len)?
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.src.source_name(),
                tensor: name.into(),
            })
    }

    pub(crate) fn vector(&mut self, name: &str, len: usize) -> Result<Option<B::Tensor>> {
        let Some(w) = self.src.get(name)? else {
            return Ok(None);
        };
        self.check(&w, &[len])?;
        self.bytes += len * 4;
        Ok(Some(self.backend.vector(w)?))
    }

    pub(crate) fn norm(&mut self, name: &str, len: usize) -> Result<Option<B::Tensor>> {
        let Some(w) = self.src.get(name)? else {
            return Ok(None);
        };
        self.check(&w, &[len])?;
        self.bytes += len * 4;
        if !self.cfg.norm_weight_offset {
            return Ok(Some(self.backend.vector(w)?));
        }
        // Stored as an offset from one: upload 1 + w as f32.
        let values = w.float_values("norm weight")?;
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| (v + 1.0).to_le_bytes())
            .collect();
        let w = HostWeight {
            name: w.name,
            dtype: GgmlType::F32,
            shape: w.shape,
            bytes: Cow::Owned(bytes),
        };
        Ok(Some(self.backend.vector(w)?))
    }

    pub(crate) fn required_norm(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        self.norm(name, len)?
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.src.source_name(),
                tensor: name.into(),
            })
    }

    /// The norm `<prefix>.weight` (and `<prefix>.bias` for a LayerNorm).
    pub(crate) fn full_norm(&mut self, prefix: &str, len: usize) -> Result<Norm<B>> {
        let weight = self.required_norm(&format!("{prefix}.weight"), len)?;
        let bias = match self.cfg.features.norm {
            NormKind::Rms => None,
            NormKind::Layer => self.vector(&format!("{prefix}.bias"), len)?,
        };
        Ok(Norm { weight, bias })
    }
}
