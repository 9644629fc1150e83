//! Embedding models: text in, one vector out.
//!
//! Two kinds run here:
//! - encoders ([`bert`]): BERT-family checkpoints such as all-MiniLM-L6-v2, bidirectional,
//!   on the host with wick-kernels' products;
//! - decoder embedders: a causal decoder (Qwen3-Embedding style) loaded as a [`Model`],
//!   whose final-normed hidden states are pooled (by default the last token's).
//!
//! How states become a vector — pooling mode, L2 normalisation, the truncation length,
//! named prompts, Matryoshka dimensions — comes from the directory's sentence-transformers
//! files ([`st_config`]), so results match `SentenceTransformer(dir).encode(...)`. A batch
//! of inputs runs as one forward pass (split only past [`BATCH_TOKENS`] tokens).
pub mod bert;
pub mod st_config;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use wick_chat::tokenizer::Tokenizer;

use self::bert::{BertConfig, BertEncoder};
pub use self::st_config::{Pooling, SentenceConfig};
use crate::models::decoder::LogitsRequest;
use crate::weights::SafetensorsWeights;
use crate::{EngineError, LoadOptions, Model, Result, Step};

/// Most tokens one forward pass takes; a larger batch runs in several.
pub const BATCH_TOKENS: usize = 8192;

/// The `model_type`s of `config.json` that load as encoders.
pub const ENCODER_TYPES: &[&str] = &["bert"];

/// Facts about a loaded embedding model.
#[derive(Debug, Clone)]
pub struct EmbedderInfo {
    /// Display name (the directory's or file's name).
    pub name: String,
    /// Where it was loaded from.
    pub path: PathBuf,
    /// `config.json`'s `model_type` (`bert`, `qwen3` …).
    pub arch: String,
    /// Length of the vectors.
    pub dimensions: usize,
    /// Longest input in tokens: texts are cut to it, longer id inputs are refused.
    pub max_tokens: usize,
    /// Pooling mode.
    pub pooling: Pooling,
    /// Whether vectors are L2-normalised.
    pub normalize: bool,
    /// Smallest `dimensions` a request may ask for, when the model declares Matryoshka
    /// dimensions (`None`: only the full length).
    pub matryoshka_min: Option<usize>,
    /// Bytes of weights.
    pub weight_bytes: usize,
    /// Whether the model is an encoder (else a decoder embedder).
    pub encoder: bool,
}

enum Kind {
    Encoder(Box<BertEncoder>),
    Decoder(Arc<Model>),
}

/// A loaded embedding model.
pub struct Embedder {
    kind: Kind,
    tokenizer: Tokenizer,
    st: SentenceConfig,
    info: EmbedderInfo,
    vocab: usize,
    /// Ids the tokenizer's template puts before and after a text.
    frame: (usize, usize),
}

fn read_config(dir: &Path) -> Result<Option<Value>> {
    let path = dir.join("config.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| EngineError::Config {
                source_name: path.display().to_string(),
                reason: format!("not valid JSON: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(EngineError::Io { path, source }),
    }
}

fn display_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// How many ids `tok`'s template puts before and after a text.
fn template_frame(tok: &Tokenizer) -> (usize, usize) {
    let (Ok(with), Ok(body)) = (
        tok.encode_literal("a", true),
        tok.encode_literal("a", false),
    ) else {
        return (0, 0);
    };
    if body.is_empty() || with.len() < body.len() {
        return (0, 0);
    }
    (0..=with.len() - body.len())
        .find(|&i| with[i..i + body.len()] == body[..])
        .map_or((0, 0), |i| (i, with.len() - body.len() - i))
}

impl Embedder {
    /// Whether `path` is a model directory whose `config.json` names an encoder
    /// architecture (which [`Model::load`] does not run).
    pub fn is_encoder(path: &Path) -> bool {
        path.is_dir()
            && read_config(path)
                .ok()
                .flatten()
                .and_then(|c| {
                    c.get("model_type")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .is_some_and(|t| ENCODER_TYPES.contains(&t.as_str()))
    }

    /// Loads an embedding model: an encoder directory, or any decoder [`Model::load`]
    /// accepts (its sentence-transformers files, if any, say how to pool).
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self> {
        if Self::is_encoder(path) {
            return Self::load_encoder(path);
        }
        Self::from_decoder(Arc::new(Model::load(path, opts)?))
    }

    fn load_encoder(dir: &Path) -> Result<Self> {
        let source = dir.display().to_string();
        let json = read_config(dir)?.ok_or_else(|| EngineError::Config {
            source_name: source.clone(),
            reason: "no config.json".into(),
        })?;
        let cfg = BertConfig::from_json(&json, &source)?;
        let weights = SafetensorsWeights::open(dir)?;
        let encoder = BertEncoder::load(cfg.clone(), &weights, &source)?;
        let tokenizer = Tokenizer::from_hf_dir(dir)?;
        let st = SentenceConfig::read(dir, Pooling::Mean, false)?;
        let max_tokens = st
            .max_seq_length
            .map_or(cfg.max_positions, |m| m.min(cfg.max_positions));
        let info = EmbedderInfo {
            name: display_name(dir),
            path: dir.to_path_buf(),
            arch: "bert".into(),
            dimensions: cfg.hidden_size,
            max_tokens,
            pooling: st.pooling,
            normalize: st.normalize,
            matryoshka_min: st.matryoshka_min.filter(|&m| m < cfg.hidden_size),
            weight_bytes: encoder.weight_bytes(),
            encoder: true,
        };
        tracing::info!(model = %info.name, dims = info.dimensions, pooling = info.pooling.name(), normalize = info.normalize, "loaded encoder");
        Ok(Embedder {
            frame: template_frame(&tokenizer),
            kind: Kind::Encoder(Box::new(encoder)),
            tokenizer,
            st,
            info,
            vocab: cfg.vocab_size,
        })
    }

    /// A decoder served as an embedder: pooled as its directory's sentence-transformers
    /// files say, else by the last token, L2-normalised (Qwen3-Embedding's recipe).
    pub fn from_decoder(model: Arc<Model>) -> Result<Self> {
        let mi = model.info().clone();
        let cfg = model.config();
        let st = if mi.path.is_dir() {
            SentenceConfig::read(&mi.path, Pooling::LastToken, true)?
        } else {
            SentenceConfig::defaults(Pooling::LastToken, true)
        };
        let max_tokens = st
            .max_seq_length
            .map_or(mi.context_length, |m| m.min(mi.context_length));
        let info = EmbedderInfo {
            name: mi.name.clone(),
            path: mi.path.clone(),
            arch: mi.arch.to_string(),
            dimensions: cfg.hidden_size,
            max_tokens,
            pooling: st.pooling,
            normalize: st.normalize,
            matryoshka_min: st.matryoshka_min.filter(|&m| m < cfg.hidden_size),
            weight_bytes: mi.weight_bytes,
            encoder: false,
        };
        let tokenizer = model.tokenizer().clone();
        Ok(Embedder {
            frame: template_frame(&tokenizer),
            vocab: cfg.vocab_size,
            kind: Kind::Decoder(model),
            tokenizer,
            st,
            info,
        })
    }

    /// Facts about the model.
    pub fn info(&self) -> &EmbedderInfo {
        &self.info
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The sentence-transformers settings.
    pub fn sentence_config(&self) -> &SentenceConfig {
        &self.st
    }

    /// The text put before an input: `instruction` in Qwen3-Embedding's query format
    /// (`Instruct: {instruction}\nQuery:`), else the prompt named `prompt_name` in the
    /// model's config, else its default prompt.
    pub fn prompt(
        &self,
        prompt_name: Option<&str>,
        instruction: Option<&str>,
    ) -> Result<Option<String>> {
        if let Some(i) = instruction {
            return Ok(Some(format!("Instruct: {i}\nQuery:")));
        }
        match prompt_name.or(self.st.default_prompt.as_deref()) {
            None => Ok(None),
            Some(name) => match self.st.prompts.get(name) {
                Some(p) => Ok(Some(p.clone())),
                None => Err(EngineError::InvalidInput(format!(
                    "unknown prompt_name '{name}' (the model has: {})",
                    if self.st.prompts.is_empty() {
                        "none".to_string()
                    } else {
                        self.st
                            .prompts
                            .keys()
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ))),
            },
        }
    }

    /// Ids of `prompt` + `text` with the tokenizer's template (`[CLS] … [SEP]`, a trailing
    /// EOS), special-token strings in the text kept as text, cut to
    /// [`EmbedderInfo::max_tokens`] the way sentence-transformers cuts (the template's
    /// ids kept).
    pub fn encode_text(&self, text: &str, prompt: Option<&str>) -> Result<Vec<u32>> {
        let full;
        let text = match prompt {
            Some(p) if !p.is_empty() => {
                full = format!("{p}{text}");
                &full
            }
            _ => text,
        };
        let mut ids = self.tokenizer.encode_literal(text, true)?;
        let max = self.info.max_tokens;
        if ids.len() > max {
            let (before, after) = self.frame;
            if before + after < max {
                let tail = ids.split_off(ids.len() - after);
                ids.truncate(max - after);
                ids.extend(tail);
            } else {
                ids.truncate(max);
            }
        }
        Ok(ids)
    }

    /// Checks token ids given directly: not empty, no longer than the model takes, inside
    /// the vocabulary.
    pub fn check_ids(&self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(EngineError::InvalidInput("an input has no tokens".into()));
        }
        if ids.len() > self.info.max_tokens {
            return Err(EngineError::ContextOverflow {
                needed: ids.len(),
                limit: self.info.max_tokens,
            });
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.vocab
            )));
        }
        Ok(())
    }

    /// Checks a requested vector length: the full length, or, when the model declares
    /// Matryoshka dimensions, anything from the smallest of them up.
    pub fn check_dimensions(&self, dimensions: usize) -> Result<()> {
        let full = self.info.dimensions;
        if dimensions == full {
            return Ok(());
        }
        match self.info.matryoshka_min {
            Some(min) if (min..full).contains(&dimensions) => Ok(()),
            Some(min) => Err(EngineError::InvalidInput(format!(
                "dimensions must be between {min} and {full} for this model, got {dimensions}"
            ))),
            None => Err(EngineError::InvalidInput(format!(
                "this model does not support dimensions other than {full} (it declares no Matryoshka dimensions), got {dimensions}"
            ))),
        }
    }

    /// The vectors of `inputs` (token ids, as [`Embedder::encode_text`] makes them or
    /// checked by [`Embedder::check_ids`]), run as one batch, each `dimensions` long
    /// (truncated and renormalised, for Matryoshka models) or the full length.
    pub fn embed(&self, inputs: &[Vec<u32>], dimensions: Option<usize>) -> Result<Vec<Vec<f32>>> {
        for ids in inputs {
            self.check_ids(ids)?;
        }
        if let Some(d) = dimensions {
            self.check_dimensions(d)?;
        }
        let mut out = Vec::with_capacity(inputs.len());
        let mut start = 0;
        while start < inputs.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < inputs.len() && (end == start || tokens + inputs[end].len() <= BATCH_TOKENS)
            {
                tokens += inputs[end].len();
                end += 1;
            }
            out.extend(self.embed_batch(&inputs[start..end])?);
            start = end;
        }
        for v in &mut out {
            if let Some(d) = dimensions {
                v.truncate(d);
            }
            if self.info.normalize {
                normalize(v);
            }
        }
        Ok(out)
    }

    /// Pooled (not yet normalised) vectors of one forward pass.
    fn embed_batch(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let hidden = self.info.dimensions;
        let pooling = self.info.pooling;
        let states = match &self.kind {
            Kind::Encoder(e) => e.forward(inputs)?,
            Kind::Decoder(model) => {
                let request = match pooling {
                    Pooling::LastToken => LogitsRequest::Last,
                    _ => LogitsRequest::All,
                };
                let mut caches: Vec<_> = inputs.iter().map(|_| model.new_cache()).collect();
                let mut steps: Vec<Step<'_>> = inputs
                    .iter()
                    .zip(caches.iter_mut())
                    .map(|(ids, cache)| Step {
                        tokens: ids,
                        cache,
                        logits: request,
                    })
                    .collect();
                model.hidden_states(&mut steps)?
            }
        };
        Ok(states
            .iter()
            .map(|s| match (pooling, &self.kind) {
                // Only the last row came back.
                (Pooling::LastToken, Kind::Decoder(_)) => s.clone(),
                _ => pooling.pool(s, hidden),
            })
            .collect())
    }
}

/// Divides `v` by its L2 norm (by at least 1e-12, as `torch.nn.functional.normalize`).
pub fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt()
        .max(1e-12);
    v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_makes_unit_vectors_and_leaves_zero_alone() {
        let mut v = vec![3.0, 4.0];
        normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
        let mut z = vec![0.0, 0.0];
        normalize(&mut z);
        assert_eq!(z, vec![0.0, 0.0]);
    }
}
