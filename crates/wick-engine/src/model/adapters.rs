//! [`Model`]'s adapter surface: loading an adapter onto the model's backend, and forward
//! passes whose sequences each run with their own adapter stack.
use std::path::Path;

use super::dispatch::{with_decoder, AnyDecoder};
use super::{Model, ModelFormat};
use crate::adapters::{
    choose_factor_dtype, load::QkPermutation, validate_id, Adapter, AdapterDtype, AdapterError,
    AdapterInfo, FactorDtype, LoraOf, LoraWeights, Target,
};
use crate::backend::capability::Capability;
use crate::backend::RopeStyle;
use crate::models::decoder::Decoder;
use crate::Result;

impl Model {
    /// How adapters mounted from now on keep their factors (`auto` unless set): see
    /// [`AdapterDtype`].
    pub fn set_adapter_dtype(&mut self, dtype: AdapterDtype) {
        self.adapter_dtype = dtype;
    }

    /// Reads the adapter at `path` (a PEFT or mlx-lm directory, or a llama.cpp GGUF
    /// adapter), checks it against this model (all or nothing) and uploads its deltas to
    /// the model's backend, under `id`. Runs on the caller's thread: the engine keeps
    /// stepping meanwhile.
    pub fn load_adapter(&self, id: &str, path: &Path) -> Result<Adapter> {
        validate_id(id)?;
        let cfg = self.config();
        let permute = (self.info.format == ModelFormat::Gguf
            && cfg.rope_style == RopeStyle::Interleaved)
            .then_some(QkPermutation {
                heads: cfg.num_heads,
                kv_heads: cfg.num_kv_heads,
            });
        if let Err(e) = &self.support().adapters {
            return Err(AdapterError::invalid(path, e.to_string()).into());
        }
        let host = crate::adapters::load_host(path, cfg, permute)?;
        if !host.expert_deltas.is_empty() && !self.capabilities().has(Capability::ExpertAdapters) {
            return Err(AdapterError::invalid(
                path,
                format!(
                    "it adapts the mixture-of-experts weights: {} run on the cpu and mlx \
                     backends for now, not on {}",
                    Capability::ExpertAdapters.describe(),
                    self.capabilities().backend
                ),
            )
            .into());
        }
        let layers = cfg.num_layers;
        let (dtype, why) = if self.capabilities().has(Capability::HalfAdapterFactors) {
            choose_factor_dtype(&host, self.adapter_dtype, self.base_precision)
        } else {
            (FactorDtype::F32, "the backend takes f32 factors only")
        };
        tracing::info!(
            adapter = id,
            factors = dtype.name(),
            reason = why,
            "adapter factors"
        );
        let weights = with_decoder!(&self.decoder, d => upload_on(d, &host, layers, dtype)?);
        // A cached prompt made with rounded factors is not one made with the file's.
        let digest = match dtype {
            FactorDtype::F32 => host.digest(),
            other => xxhash_rust::xxh3::xxh3_64_with_seed(other.name().as_bytes(), host.digest()),
        };
        let info = AdapterInfo {
            id: id.to_string(),
            path: path.to_path_buf(),
            format: host.format,
            rank: host.rank(),
            scale: host.scale(),
            size_bytes: host.size_bytes() / 4 * dtype.bytes(),
            factor_dtype: dtype,
            // Qwen 3.5's q_proj is one layer of the file, kept as two deltas.
            mounted_layers: host
                .deltas
                .iter()
                .filter(|d| d.target != Target::QGate)
                .count()
                + host.expert_deltas.len(),
            skipped_tensors: host.skipped_tensors,
            base_model: host.base_model.clone(),
            digest,
        };
        Ok(Adapter::new(info, weights))
    }
}

fn upload_on<B: LoraOf>(
    d: &Decoder<B>,
    host: &crate::adapters::HostAdapter,
    layers: usize,
    dtype: FactorDtype,
) -> Result<crate::adapters::AnyLora> {
    Ok(B::wrap_lora(LoraWeights::upload(
        d.backend(),
        host,
        layers,
        dtype,
    )?))
}

impl From<AdapterError> for crate::EngineError {
    fn from(e: AdapterError) -> Self {
        crate::EngineError::Adapter(e)
    }
}
