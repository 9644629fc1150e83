//! The BERT encoder (`model_type: bert`, as sentence-transformers' MiniLM/MPNet-style BERT
//! checkpoints ship it): word + absolute position + token type embeddings, LayerNorm,
//! bidirectional multi-head attention and a GELU MLP, post-norm residuals. It runs on the
//! host with wick-kernels' matrix products; a batch of sequences is flattened into rows and
//! each sequence attends only to itself.
use rayon::prelude::*;
use serde_json::Value;
use wick_gguf::GgmlType;
use wick_kernels::{
    matmul, Isa, PackedMatrix, Product, QuantizedActivations, ThreadPool, WeightFormat,
};

use crate::weights::{HostWeight, SafetensorsWeights};
use crate::{EngineError, Result};

/// Largest sizes a configuration may declare (checked before anything is allocated).
const MAX_HIDDEN: usize = 16_384;
const MAX_LAYERS: usize = 256;
const MAX_VOCAB: usize = 1 << 20;
const MAX_POSITIONS: usize = 1 << 16;

/// The MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    /// `x · Φ(x)` with the exact normal CDF (`gelu`).
    Gelu,
    /// The tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    /// `max(x, 0)`.
    Relu,
}

/// The hyperparameters of a BERT `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width of the hidden states (the embedding dimension).
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Positions the position table holds (the longest input).
    pub max_positions: usize,
    /// Rows of the token type table.
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f32,
    act: Act,
}

impl BertConfig {
    /// Reads and checks a BERT `config.json`.
    pub fn from_json(json: &Value, source: &str) -> Result<Self> {
        let bad = |reason: String| EngineError::Config {
            source_name: source.to_string(),
            reason,
        };
        let size = |key: &str, max: usize| -> Result<usize> {
            let v = json
                .get(key)
                .and_then(Value::as_u64)
                .ok_or_else(|| bad(format!("'{key}' is missing or not a number")))?;
            if v == 0 || v > max as u64 {
                return Err(bad(format!("'{key}' = {v} is outside 1..={max}")));
            }
            Ok(v as usize)
        };
        let hidden_size = size("hidden_size", MAX_HIDDEN)?;
        let num_heads = size("num_attention_heads", hidden_size)?;
        if hidden_size % num_heads != 0 {
            return Err(bad(format!(
                "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"
            )));
        }
        let act = match json
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("gelu")
        {
            "gelu" => Act::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Act::GeluTanh,
            "relu" => Act::Relu,
            other => {
                return Err(bad(format!(
                "hidden_act '{other}' is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu)"
            )))
            }
        };
        match json.get("position_embedding_type").and_then(Value::as_str) {
            None | Some("absolute") => {}
            Some(other) => {
                return Err(bad(format!(
                    "position_embedding_type '{other}' is not supported (absolute)"
                )))
            }
        }
        let eps = json
            .get("layer_norm_eps")
            .and_then(Value::as_f64)
            .unwrap_or(1e-12);
        if !(eps > 0.0 && eps < 1.0) {
            return Err(bad(format!("layer_norm_eps {eps} is outside (0, 1)")));
        }
        Ok(BertConfig {
            vocab_size: size("vocab_size", MAX_VOCAB)?,
            hidden_size,
            num_layers: size("num_hidden_layers", MAX_LAYERS)?,
            num_heads,
            intermediate_size: size("intermediate_size", 8 * MAX_HIDDEN)?,
            max_positions: size("max_position_embeddings", MAX_POSITIONS)?,
            type_vocab_size: json
                .get("type_vocab_size")
                .map(|_| size("type_vocab_size", 1024))
                .transpose()?
                .unwrap_or(1),
            layer_norm_eps: eps as f32,
            act,
        })
    }
}

struct Linear {
    w: PackedMatrix,
    b: Vec<f32>,
}

struct LayerNorm {
    w: Vec<f32>,
    b: Vec<f32>,
}

struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    out_norm: LayerNorm,
}

/// A loaded BERT encoder.
pub struct BertEncoder {
    cfg: BertConfig,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    embed_norm: LayerNorm,
    layers: Vec<Layer>,
    weight_bytes: usize,
}

struct Loader<'a> {
    src: &'a SafetensorsWeights,
    source: String,
    /// `""` or `"bert."` (checkpoints saved from a task head keep the encoder under `bert`).
    prefix: &'static str,
    bytes: usize,
}

impl<'a> Loader<'a> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<HostWeight<'a>> {
        let full = format!("{}{name}", self.prefix);
        let w = self
            .src
            .raw(&full)
            .ok_or_else(|| EngineError::MissingTensor {
                source_name: self.source.clone(),
                tensor: full.clone(),
            })?;
        if w.shape != shape {
            return Err(EngineError::ShapeMismatch {
                source_name: self.source.clone(),
                tensor: full,
                expected: shape.to_vec(),
                found: w.shape.clone(),
            });
        }
        Ok(w)
    }

    fn values(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let v = self.get(name, shape)?.float_values(&self.source)?;
        self.bytes += v.len() * 4;
        Ok(v)
    }

    fn linear(&mut self, name: &str, rows: usize, cols: usize) -> Result<Linear> {
        let w = self.get(&format!("{name}.weight"), &[rows, cols])?;
        let format = match w.dtype {
            GgmlType::F32 => WeightFormat::F32,
            GgmlType::F16 => WeightFormat::F16,
            GgmlType::Bf16 => WeightFormat::Bf16,
            other => {
                return Err(EngineError::UnsupportedDtype {
                    source_name: self.source.clone(),
                    tensor: w.name.clone(),
                    dtype: other.to_string(),
                })
            }
        };
        let w = PackedMatrix::from_ggml(format, rows, cols, &w.bytes)?;
        self.bytes += rows * cols * format.block_bytes();
        Ok(Linear {
            w,
            b: self.values(&format!("{name}.bias"), &[rows])?,
        })
    }

    fn norm(&mut self, name: &str, len: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            w: self.values(&format!("{name}.weight"), &[len])?,
            b: self.values(&format!("{name}.bias"), &[len])?,
        })
    }
}

impl BertEncoder {
    /// Loads the encoder's weights from `src` (the model directory's safetensors).
    pub fn load(cfg: BertConfig, src: &SafetensorsWeights, source: &str) -> Result<Self> {
        let prefix = if src.raw("embeddings.word_embeddings.weight").is_some() {
            ""
        } else {
            "bert."
        };
        let mut ld = Loader {
            src,
            source: source.to_string(),
            prefix,
            bytes: 0,
        };
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        if src
            .raw(&format!(
                "{prefix}encoder.layer.{}.output.dense.weight",
                cfg.num_layers
            ))
            .is_some()
        {
            return Err(EngineError::Config {
                source_name: source.to_string(),
                reason: format!(
                    "the weights hold more than the configured {} layers",
                    cfg.num_layers
                ),
            });
        }
        let word = ld.values("embeddings.word_embeddings.weight", &[cfg.vocab_size, h])?;
        let position = ld.values(
            "embeddings.position_embeddings.weight",
            &[cfg.max_positions, h],
        )?;
        let token_type = ld.values(
            "embeddings.token_type_embeddings.weight",
            &[cfg.type_vocab_size, h],
        )?;
        let embed_norm = ld.norm("embeddings.LayerNorm", h)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("encoder.layer.{i}.{s}");
            layers.push(Layer {
                q: ld.linear(&n("attention.self.query"), h, h)?,
                k: ld.linear(&n("attention.self.key"), h, h)?,
                v: ld.linear(&n("attention.self.value"), h, h)?,
                attn_out: ld.linear(&n("attention.output.dense"), h, h)?,
                attn_norm: ld.norm(&n("attention.output.LayerNorm"), h)?,
                up: ld.linear(&n("intermediate.dense"), f, h)?,
                down: ld.linear(&n("output.dense"), h, f)?,
                out_norm: ld.norm(&n("output.LayerNorm"), h)?,
            });
        }
        let weight_bytes = ld.bytes;
        Ok(BertEncoder {
            cfg,
            word,
            position,
            token_type,
            embed_norm,
            layers,
            weight_bytes,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// Bytes the weights occupy.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// The last layer's hidden states of every sequence (`[len][hidden]` each, row-major),
    /// all run as one batch. Ids must be below the vocabulary size and each sequence no
    /// longer than the position table and not empty.
    pub fn forward(&self, seqs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        for s in seqs {
            if s.is_empty() || s.len() > cfg.max_positions {
                return Err(EngineError::InvalidInput(format!(
                    "an input of {} tokens is outside 1..={} for this encoder",
                    s.len(),
                    cfg.max_positions
                )));
            }
            if let Some(&bad) = s.iter().find(|&&id| id as usize >= cfg.vocab_size) {
                return Err(EngineError::InvalidInput(format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    cfg.vocab_size
                )));
            }
        }
        let n: usize = seqs.iter().map(Vec::len).sum();
        // Which sequence (start, len) every row belongs to.
        let mut spans = Vec::with_capacity(n);
        let mut x = Vec::with_capacity(n * h);
        let mut start = 0;
        for s in seqs {
            for (p, &id) in s.iter().enumerate() {
                let word = &self.word[id as usize * h..][..h];
                let pos = &self.position[p * h..][..h];
                let ty = &self.token_type[..h];
                x.extend(word.iter().zip(pos).zip(ty).map(|((a, b), c)| a + b + c));
                spans.push((start, s.len()));
            }
            start += s.len();
        }
        layer_norm(&mut x, &self.embed_norm, cfg.layer_norm_eps);

        let pool = ThreadPool::global();
        let isa = Isa::best();
        let mut act = QuantizedActivations::new();
        let (mut q, mut k, mut v) = (vec![0f32; n * h], vec![0f32; n * h], vec![0f32; n * h]);
        let mut ctx = vec![0f32; n * h];
        let mut o = vec![0f32; n * h];
        let mut up = vec![0f32; n * cfg.intermediate_size];
        for layer in &self.layers {
            matmul(
                pool,
                isa,
                &x,
                n,
                &mut [
                    product(&layer.q, &mut q),
                    product(&layer.k, &mut k),
                    product(&layer.v, &mut v),
                ],
                &mut act,
            )?;
            self.attention(&q, &k, &v, &spans, &mut ctx);
            matmul(
                pool,
                isa,
                &ctx,
                n,
                &mut [product(&layer.attn_out, &mut o)],
                &mut act,
            )?;
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            layer_norm(&mut x, &layer.attn_norm, cfg.layer_norm_eps);
            matmul(
                pool,
                isa,
                &x,
                n,
                &mut [product(&layer.up, &mut up)],
                &mut act,
            )?;
            activate(&mut up, cfg.act);
            matmul(
                pool,
                isa,
                &up,
                n,
                &mut [product(&layer.down, &mut o)],
                &mut act,
            )?;
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            layer_norm(&mut x, &layer.out_norm, cfg.layer_norm_eps);
        }
        let mut out = Vec::with_capacity(seqs.len());
        let mut rest = &x[..];
        for s in seqs {
            let (head, tail) = rest.split_at(s.len() * h);
            out.push(head.to_vec());
            rest = tail;
        }
        Ok(out)
    }

    /// Bidirectional attention: every row attends to all rows of its own sequence.
    fn attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        spans: &[(usize, usize)],
        out: &mut [f32],
    ) {
        let h = self.cfg.hidden_size;
        let heads = self.cfg.num_heads;
        let d = h / heads;
        let scale = 1.0 / (d as f32).sqrt();
        out.par_chunks_mut(h).enumerate().for_each(|(row, out)| {
            let (start, len) = spans[row];
            let qr = &q[row * h..][..h];
            let mut scores = vec![0f32; len];
            for head in 0..heads {
                let qh = &qr[head * d..][..d];
                let mut max = f32::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate() {
                    let kh = &k[(start + j) * h + head * d..][..d];
                    *s = qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * scale;
                    max = max.max(*s);
                }
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let oh = &mut out[head * d..][..d];
                oh.fill(0.0);
                for (j, &s) in scores.iter().enumerate() {
                    let w = s / sum;
                    let vh = &v[(start + j) * h + head * d..][..d];
                    oh.iter_mut().zip(vh).for_each(|(o, x)| *o += w * x);
                }
            }
        });
    }
}

fn product<'a>(l: &'a Linear, out: &'a mut [f32]) -> Product<'a> {
    Product {
        weight: &l.w,
        out,
        bias: Some(&l.b),
    }
}

/// LayerNorm of every row of `x` (rows as wide as the norm's weight), in place.
fn layer_norm(x: &mut [f32], norm: &LayerNorm, eps: f32) {
    let h = norm.w.len();
    x.par_chunks_mut(h).for_each(|row| {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for ((v, w), b) in row.iter_mut().zip(&norm.w).zip(&norm.b) {
            *v = ((*v as f64 - mean) * inv) as f32 * w + b;
        }
    });
}

fn activate(x: &mut [f32], act: Act) {
    x.par_chunks_mut(4096).for_each(|chunk| {
        for v in chunk {
            let x = *v;
            *v = match act {
                Act::Gelu => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
                Act::GeluTanh => {
                    const C: f32 = 0.797_884_6;
                    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
                }
                Act::Relu => x.max(0.0),
            };
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Value {
        serde_json::json!({
            "model_type": "bert", "vocab_size": 100, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 32,
            "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12
        })
    }

    #[test]
    fn configs_are_checked_before_use() {
        let cfg = BertConfig::from_json(&config(), "t").unwrap();
        assert_eq!(
            (cfg.hidden_size, cfg.num_heads, cfg.max_positions),
            (8, 2, 32)
        );
        let mut c = config();
        c["num_attention_heads"] = 3.into();
        let err = BertConfig::from_json(&c, "t").unwrap_err().to_string();
        assert!(err.contains("multiple"), "{err}");
        let mut c = config();
        c["hidden_size"] = (1u64 << 40).into();
        assert!(BertConfig::from_json(&c, "t").is_err());
        let mut c = config();
        c["position_embedding_type"] = "relative_key".into();
        let err = BertConfig::from_json(&c, "t").unwrap_err().to_string();
        assert!(err.contains("relative_key"), "{err}");
        let mut c = config();
        c["hidden_act"] = "swish".into();
        assert!(BertConfig::from_json(&c, "t").is_err());
    }

    #[test]
    fn gelu_is_the_exact_one() {
        let mut x = vec![-1.0f32, 0.0, 1.0, 2.0];
        activate(&mut x, Act::Gelu);
        // x · Φ(x), from the normal CDF.
        let want = [-0.158_655_26f32, 0.0, 0.841_344_7, 1.954_499_7];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }
}
