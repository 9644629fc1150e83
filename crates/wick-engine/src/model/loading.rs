//! Loading a model: a GGUF file, or a Hugging Face directory (config.json, safetensors,
//! tokenizer files, chat template, generation_config.json).
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use wick_chat::chat_template::{ChatTemplate, TemplateTokens};
use wick_chat::tokenizer::Tokenizer;
use wick_gguf::GgufFile;

use super::dispatch::{with_decoder, AnyDecoder};
use super::{GenerationDefaults, LoadOptions, Model, ModelFormat, ModelInfo};
use crate::adapters::{AdapterDtype, BasePrecision, Target};
use crate::backend::candle::{CandleBackend, KvDtype};
use crate::backend::{Backend, BackendKind};
use crate::config::ModelConfig;
use crate::models::decoder::Decoder;
use crate::weights::{
    check_regular_file, GgufWeights, MlxQuantization, SafetensorsWeights, WeightSource,
};
use crate::{EngineError, Result};

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !check_regular_file(path)? {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| EngineError::Config {
            source_name: path.display().to_string(),
            reason: format!("not valid JSON: {e}"),
        })
}

/// Every file of a Hugging Face directory that loading may open (configs, tokenizer files,
/// templates, weights) is a regular file, or a link to one: checked before any is opened,
/// since opening a FIFO blocks (a loader that hangs) and a device or directory under a
/// model file's name is a damaged directory. Other entries are never opened.
fn check_model_files(dir: &Path) -> Result<()> {
    const READ: [&str; 6] = ["json", "jinja", "safetensors", "txt", "model", "tiktoken"];
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| READ.contains(&e))
        {
            check_regular_file(&path)?;
        }
    }
    Ok(())
}

impl Model {
    /// Loads a `.gguf` file or a Hugging Face model directory.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Model> {
        let meta = std::fs::metadata(path).map_err(io(path))?;
        if !opts.backend.available() {
            return Err(EngineError::Backend {
                backend: opts.backend.name(),
                message: format!(
                    "wick was built without the `{0}` cargo feature (build with \
                     `--features {0}`; see docs/{1}.md)",
                    opts.backend.name(),
                    if opts.backend == BackendKind::Cuda {
                        "gpu"
                    } else {
                        "mlx"
                    }
                ),
            });
        }
        let mut model = if meta.is_dir() {
            check_model_files(path)?;
            Self::load_hf(path, opts.backend, opts.kv_dtype.unwrap_or(KvDtype::F32))?
        } else {
            check_regular_file(path)?;
            Self::load_gguf(path, opts.backend, opts.kv_dtype.unwrap_or(KvDtype::F16))?
        };
        if let Some(n) = opts.context_length {
            model.info.context_length = n.min(model.info.context_length).max(1);
        }
        tracing::info!(
            model = %model.info.name,
            arch = %model.info.arch,
            backend = model.info.backend,
            weights_mib = model.info.weight_bytes / (1 << 20),
            context = model.info.context_length,
            kv = model.info.kv_type,
            "model loaded"
        );
        Ok(model)
    }

    fn load_gguf(path: &Path, backend: BackendKind, kv: KvDtype) -> Result<Model> {
        let file = GgufFile::open(path)?;
        let source = path.display().to_string();
        let mut cfg = ModelConfig::from_gguf(file.metadata(), &source)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let template_source = file
            .metadata()
            .opt_str("tokenizer.chat_template")?
            .map(str::to_string);
        // GGUF scales are exact in f32 (see backend::mlx).
        let file_weights = GgufWeights::new(&file);
        crate::models::gemma4::complete_from_gguf(&mut cfg, &file_weights)?;
        // Qwen 3.5 files hold some tensors in llama.cpp's own layout (models::qwen35_gguf).
        let qwen35 = cfg
            .qwen35
            .as_ref()
            .map(|q| crate::models::Qwen35Gguf::new(&file_weights, q.delta));
        let weights: &dyn WeightSource = match &qwen35 {
            Some(view) => view,
            None => &file_weights,
        };
        let base = base_precision(weights);
        let decoder = load_decoder(backend, cfg, weights, (MlxDtype::F32, base), kv)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| source.clone());
        let mut model = Self::assemble(
            decoder,
            tokenizer,
            template_source,
            GenerationDefaults::default(),
            name,
            path,
            ModelFormat::Gguf,
        )?;
        model.base_precision = base;
        Ok(model)
    }

    fn load_hf(dir: &Path, backend: BackendKind, kv: KvDtype) -> Result<Model> {
        let source = dir.display().to_string();
        let config = read_json(&dir.join("config.json"))?.ok_or_else(|| EngineError::Config {
            source_name: source.clone(),
            reason: "no config.json: not a Hugging Face model directory".into(),
        })?;
        let mut cfg =
            ModelConfig::from_hf(&config, &dir.join("config.json").display().to_string())?;
        if let Some(vision) = cfg.gemma4.as_mut().and_then(|g| g.vision.as_mut()) {
            // Gemma 4's image budget is the processor's (`max_soft_tokens`).
            for file in ["preprocessor_config.json", "processor_config.json"] {
                let path = dir.join(file);
                if let Some(json) = read_json(&path)? {
                    vision.read_processor(&json, &path.display().to_string())?;
                    break;
                }
            }
        }
        if let Some(vision) = cfg.qwen_vision.take() {
            // Qwen's pixel budget and normalisation live with its image processor.
            let path = dir.join("preprocessor_config.json");
            cfg.qwen_vision = Some(match read_json(&path)? {
                Some(pre) => vision.with_preprocessor(&pre, &path.display().to_string())?,
                None => vision,
            });
        }
        let tokenizer = Tokenizer::from_hf_dir(dir)?;
        let weights = SafetensorsWeights::open(dir)?;
        let quantization = MlxQuantization::from_config(&config, &source)?;
        // Some families (Gemma's sandwich norms, GLM-4, StarCoder 2) use other names.
        let named = weights
            .canonical_as(cfg.features.hf_naming)
            .with_quantization(quantization);
        let dtype = MlxDtype::of_checkpoint(&config, &named);
        let base = base_precision(&named);
        let decoder = load_decoder(backend, cfg, &named, (dtype, base), kv)?;
        let template_source = hf_chat_template(dir)?;
        let gen_path = dir.join("generation_config.json");
        let gen = read_json(&gen_path)?.unwrap_or_else(|| Value::Object(Default::default()));
        crate::config::check_generation_config(&gen, &gen_path.display().to_string())?;
        let defaults = GenerationDefaults {
            temperature: gen
                .get("temperature")
                .and_then(Value::as_f64)
                .map(|v| v as f32),
            top_p: gen.get("top_p").and_then(Value::as_f64).map(|v| v as f32),
            top_k: gen.get("top_k").and_then(Value::as_u64).map(|v| v as usize),
            repetition_penalty: gen
                .get("repetition_penalty")
                .and_then(Value::as_f64)
                .map(|v| v as f32),
        };
        let mut model = {
            let name = dir
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| source.clone());
            Self::assemble(
                decoder,
                tokenizer,
                template_source,
                defaults,
                name,
                dir,
                ModelFormat::HuggingFace,
            )?
        };
        model.base_precision = base;
        // generation_config's eos ids join the set.
        let extra = crate::config::hf_ids(&gen, "eos_token_id");
        for id in extra {
            if !model.eos.contains(&id) {
                model.eos.push(id);
            }
        }
        Ok(model)
    }

    fn assemble(
        mut decoder: AnyDecoder,
        tokenizer: Tokenizer,
        template_source: Option<String>,
        defaults: GenerationDefaults,
        name: String,
        path: &Path,
        format: ModelFormat,
    ) -> Result<Model> {
        // A padded vocabulary's extra rows are never produced (models/decoder/vocab_mask.rs).
        with_decoder!(&mut decoder, d => d.mask_vocabulary(tokenizer.vocab_size()))?;
        let cfg = with_decoder!(&decoder, d => d.config());
        let weight_bytes = with_decoder!(&decoder, d => d.weight_bytes());
        let backend = with_decoder!(&decoder, d => d.backend().name());
        let kv_type = decoder.kv_dtype().map_or("mlx", KvDtype::name);
        let mut eos: Vec<u32> = cfg.eos_token_ids.clone();
        for &id in tokenizer.eos_ids() {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let template = match &template_source {
            Some(src) => {
                let tokens = TemplateTokens {
                    bos_token: tokenizer.bos_token().map(str::to_string),
                    eos_token: tokenizer.eos_token().map(str::to_string),
                    ..TemplateTokens::default()
                };
                Some(Arc::new(ChatTemplate::new(src, tokens)?))
            }
            None => None,
        };
        let info = ModelInfo {
            name,
            path: path.to_path_buf(),
            format,
            arch: cfg.arch,
            context_length: cfg.context_length,
            weight_bytes,
            backend,
            kv_type,
            media: crate::media::MediaCaps {
                vision: with_decoder!(&decoder, d => d.vision_caps()),
                audio: with_decoder!(&decoder, d => d.audio_caps()),
            },
        };
        Ok(Model {
            decoder,
            tokenizer,
            template,
            template_source,
            info,
            defaults,
            eos,
            grammars: Default::default(),
            adapter_dtype: AdapterDtype::Auto,
            // Set by the loader that read the weights.
            base_precision: BasePrecision::Exact,
        })
    }
}

/// Whether the base model's projections compute on f32 weights: those of layer 0, the
/// first that the file holds (an affine-quantized, quantized or half-precision one is
/// [`BasePrecision::Rounded`]); a model without any is taken as exact.
fn base_precision(weights: &dyn WeightSource) -> BasePrecision {
    for stem in Target::ALL.iter().filter_map(|t| t.gguf_stem()) {
        let name = format!("blk.0.{stem}.weight");
        if let Ok(Some(_)) = weights.affine(&name) {
            return BasePrecision::Rounded;
        }
        if let Ok(Some(w)) = weights.get(&name) {
            return match w.dtype {
                wick_gguf::GgmlType::F32 => BasePrecision::Exact,
                _ => BasePrecision::Rounded,
            };
        }
    }
    BasePrecision::Exact
}

/// Activation dtype for the MLX backend, chosen from the checkpoint (candle ignores it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MlxDtype {
    F32,
    F16,
    Bf16,
}

impl MlxDtype {
    /// `config.json`'s `torch_dtype`/`dtype`, else the embedding table's scales or
    /// weight type; bf16 when nothing says.
    fn of_checkpoint(config: &Value, weights: &dyn WeightSource) -> MlxDtype {
        let named = config
            .get("torch_dtype")
            .or_else(|| config.get("dtype"))
            .and_then(Value::as_str);
        let from_file = || -> Option<wick_gguf::GgmlType> {
            if let Ok(Some(a)) = weights.affine("token_embd.weight") {
                return Some(a.scales.dtype);
            }
            weights
                .get("token_embd.weight")
                .ok()
                .flatten()
                .map(|w| w.dtype)
        };
        match named {
            Some("float32") => MlxDtype::F32,
            Some("float16") => MlxDtype::F16,
            Some("bfloat16") => MlxDtype::Bf16,
            _ => match from_file() {
                Some(wick_gguf::GgmlType::F32) => MlxDtype::F32,
                Some(wick_gguf::GgmlType::F16) => MlxDtype::F16,
                _ => MlxDtype::Bf16,
            },
        }
    }
}

/// Loads the decoder onto `backend`; `base` says whether the weights are f32 (the CPU
/// backend then keeps long prompts' attention products in f32).
fn load_decoder(
    backend: BackendKind,
    cfg: ModelConfig,
    src: &dyn WeightSource,
    (dtype, base): (MlxDtype, BasePrecision),
    kv: KvDtype,
) -> Result<AnyDecoder> {
    match backend {
        BackendKind::Candle => Ok(AnyDecoder::Candle(Decoder::load(
            CandleBackend::cpu()
                .with_kv_dtype(kv)
                .with_prompt_attention_for(base),
            cfg,
            src,
        )?)),
        #[cfg(feature = "mlx")]
        BackendKind::Mlx => {
            let be = crate::backend::mlx::MlxBackend::for_checkpoint(match dtype {
                MlxDtype::F32 => wick_mlx::Dtype::F32,
                MlxDtype::F16 => wick_mlx::Dtype::F16,
                MlxDtype::Bf16 => wick_mlx::Dtype::BF16,
            })?;
            let d = Decoder::load(be, cfg, src)?;
            d.backend().log_load_report();
            Ok(AnyDecoder::Mlx(d))
        }
        #[cfg(not(feature = "mlx"))]
        BackendKind::Mlx => {
            let _ = dtype;
            Err(EngineError::Backend {
                backend: "mlx",
                message: "wick was built without the `mlx` cargo feature".into(),
            })
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let be = crate::backend::cuda::CudaBackend::new(0)?.with_kv_dtype(kv);
            Ok(AnyDecoder::Cuda(Decoder::load(be, cfg, src)?))
        }
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => Err(EngineError::Backend {
            backend: "cuda",
            message: "wick was built without the `cuda` cargo feature".into(),
        }),
    }
}

/// The chat template of a Hugging Face directory: `chat_template.jinja`, else
/// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates
/// of which `default` is used).
fn hf_chat_template(dir: &Path) -> Result<Option<String>> {
    let file = dir.join("chat_template.jinja");
    if file.is_file() {
        return std::fs::read_to_string(&file).map(Some).map_err(io(&file));
    }
    let Some(cfg) = read_json(&dir.join("tokenizer_config.json"))? else {
        return Ok(None);
    };
    Ok(match cfg.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    })
}
