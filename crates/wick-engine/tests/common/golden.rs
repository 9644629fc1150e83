//! Goldens on disk: where they are, their JSON and tensors, and the text goldens of
//! `tests/goldens/hf` (a tiny random model made by a script in `scripts/goldens/`, its
//! `reference.json` with each case's token ids and the greedy continuation, and
//! `logits.safetensors` with transformers' f32 logits at every position of each case)
//! with their model loaded straight from the directory.
use std::path::{Path, PathBuf};

use wick_engine::backend::candle::CandleBackend;
use wick_engine::backend::Backend;
use wick_engine::config::ModelConfig;
use wick_engine::models::decoder::Decoder;
use wick_engine::weights::{MlxQuantization, SafetensorsWeights};
use wick_engine::LogitsRequest;

use super::logits::{assert_near, forward_all, forward_batch, pass};

/// The text goldens of hf_reference: one tiny model per architecture (the last nine are
/// the dense families of models/dense.rs, see scripts/goldens/hf_tiny_models.py).
pub const TEXT_GOLDENS: [&str; 14] = [
    "llama",
    "llama_tied",
    "qwen2",
    "qwen3",
    "gemma3",
    "mistral",
    "phi3",
    "gemma2",
    "olmo2",
    "granite",
    "starcoder2",
    "smollm3",
    "glm4",
    "minicpm",
];

/// The goldens folder (`tests/goldens`). `WICK_GOLDENS` names it when a test binary runs
/// away from its checkout (the CUDA tests on a GPU machine).
pub fn goldens() -> PathBuf {
    std::env::var_os("WICK_GOLDENS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens"))
}

/// The directory of Hugging Face golden `name` (`tests/goldens/hf/NAME`).
pub fn golden_dir(name: &str) -> PathBuf {
    goldens().join("hf").join(name)
}

/// The JSON file at `path`.
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON list of token ids.
pub fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// The f32 tensor `name`.
pub fn floats(w: &SafetensorsWeights, name: &str) -> Vec<f32> {
    w.raw(name)
        .unwrap()
        .bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `logits.safetensors` of golden directory `dir`.
pub fn stored_logits(dir: &Path) -> SafetensorsWeights {
    SafetensorsWeights::open_files(dir, &[dir.join("logits.safetensors")]).unwrap()
}

/// A tensor to write: name, dtype (`F32`, `U32`, `BF16` …), shape and little-endian bytes.
pub type Tensor = (String, String, Vec<usize>, Vec<u8>);

/// Writes `tensors` to `file` in the safetensors format, in order.
pub fn write_safetensors(file: &Path, tensors: Vec<Tensor>) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, b) in tensors {
        let at = data.len();
        data.extend_from_slice(&b);
        header.insert(
            name,
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, data.len()]}),
        );
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(file, bytes).unwrap();
}

/// A text golden: its cases' token ids and transformers' f32 logits at every position of
/// each.
pub struct TextGolden {
    pub dir: PathBuf,
    pub reference: serde_json::Value,
    pub logits: SafetensorsWeights,
}

impl TextGolden {
    pub fn open(name: &str) -> TextGolden {
        let dir = golden_dir(name);
        TextGolden {
            reference: read_json(&dir.join("reference.json")),
            logits: stored_logits(&dir),
            dir,
        }
    }

    /// The golden's `config.json`.
    pub fn config(&self) -> serde_json::Value {
        read_json(&self.dir.join("config.json"))
    }

    /// The golden's model on backend `be`, loaded straight from its safetensors.
    pub fn decoder<B: Backend>(&self, be: B) -> Decoder<B> {
        decoder_from_dir(be, &self.dir)
    }

    /// The token ids of case `name`.
    pub fn case_ids(&self, name: &str) -> Vec<u32> {
        let case = self.reference["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        ids_of(&case["ids"])
    }

    /// transformers' logits of case `name`, every position.
    pub fn expected(&self, name: &str) -> Vec<f32> {
        floats(&self.logits, &format!("{name}.logits"))
    }

    /// The greedy case: its prompt and transformers' greedy continuation.
    pub fn greedy(&self) -> (Vec<u32>, Vec<u32>) {
        let greedy = &self.reference["greedy"];
        (
            ids_of(&greedy["prompt_ids"]),
            ids_of(&greedy["continuation_ids"]),
        )
    }
}

/// A text golden with its model on the CPU backend.
pub struct CpuGolden {
    pub model: Decoder<CandleBackend>,
    pub golden: TextGolden,
}

impl std::ops::Deref for CpuGolden {
    type Target = TextGolden;
    fn deref(&self) -> &TextGolden {
        &self.golden
    }
}

impl CpuGolden {
    /// Golden `name` and its model.
    pub fn load(name: &str) -> CpuGolden {
        let golden = TextGolden::open(name);
        CpuGolden {
            model: golden.decoder(CandleBackend::cpu()),
            golden,
        }
    }

    /// Golden `name` with its model built from `config` instead of its `config.json`.
    pub fn load_with(name: &str, config: &serde_json::Value) -> CpuGolden {
        let golden = TextGolden::open(name);
        CpuGolden {
            model: load_decoder(CandleBackend::cpu(), &golden.dir, config).unwrap(),
            golden,
        }
    }

    /// The logits of every position of `ids`, in one pass on a fresh cache.
    pub fn all(&self, ids: &[u32]) -> Vec<f32> {
        forward_all(&self.model, ids, &[ids.len()])
    }

    /// Cases `pair_a` (every position) and `pair_b` (the positions `b_logits` asks for)
    /// prefilled in one batch match transformers'; then both decode one token in one
    /// step (each fed its first token again), sequences of different lengths, and each
    /// row matches its sequence run alone.
    pub fn batched_pair_matches_single_runs(&self, variant: &str, b_logits: LogitsRequest) {
        let m = &self.model;
        let (a, b) = (self.case_ids("pair_a"), self.case_ids("pair_b"));
        let (mut ca, mut cb) = (m.new_cache(), m.new_cache());
        let out = forward_batch(
            m,
            vec![(&a, &mut ca, LogitsRequest::All), (&b, &mut cb, b_logits)],
        );
        assert_near(variant, "pair_a batched", &out[0], &self.expected("pair_a"));
        let want_b = self.expected("pair_b");
        let vocab = m.config().vocab_size;
        match b_logits {
            LogitsRequest::Last => assert_near(
                variant,
                "pair_b batched last row",
                &out[1],
                &want_b[want_b.len() - vocab..],
            ),
            _ => assert_near(variant, "pair_b batched", &out[1], &want_b),
        }
        let step = forward_batch(
            m,
            vec![
                (&a[..1], &mut ca, LogitsRequest::Last),
                (&b[..1], &mut cb, LogitsRequest::Last),
            ],
        );
        for (seq, got) in [(&a, &step[0]), (&b, &step[1])] {
            let mut ids = seq.clone();
            ids.push(seq[0]);
            let alone = pass(m, &ids, &mut m.new_cache(), LogitsRequest::Last).unwrap();
            assert_near(variant, "batched decode step", got, &alone.data);
        }
    }
}

/// The model of a Hugging Face directory (`config.json`, `model.safetensors`) on `be`.
pub fn decoder_from_dir<B: Backend>(be: B, d: &Path) -> Decoder<B> {
    load_decoder(be, d, &read_json(&d.join("config.json"))).unwrap()
}

/// The model of `d`'s `model.safetensors` as `config` describes it, on `be` (the
/// config must parse; loading the weights may fail).
pub fn load_decoder<B: Backend>(
    be: B,
    d: &Path,
    config: &serde_json::Value,
) -> wick_engine::Result<Decoder<B>> {
    let cfg = ModelConfig::from_hf(config, &d.display().to_string()).unwrap();
    let weights = SafetensorsWeights::open_files(d, &[d.join("model.safetensors")]).unwrap();
    let quantization = MlxQuantization::from_config(config, "test").unwrap();
    Decoder::load(
        be,
        cfg.clone(),
        &weights
            .canonical_as(cfg.features.hf_naming)
            .with_quantization(quantization),
    )
}
