//! llama.cpp's greedy goldens of the real GGUF models (`tests/goldens/llamacpp`, made by
//! scripts/goldens/llamacpp_greedy.py; the models come from `wick pull`), and those models
//! loaded straight from their GGUF on any backend.
use std::path::PathBuf;

use wick_engine::backend::Backend;
use wick_engine::config::ModelConfig;
use wick_engine::models::decoder::Decoder;
use wick_engine::weights::GgufWeights;

use super::golden::{goldens, ids_of, read_json};
use super::serving::model_file;

/// One prompt of a llama.cpp golden.
pub struct Case {
    pub name: String,
    /// llama.cpp's margin between its best and second-best logit at each greedy step.
    pub gaps: Vec<f64>,
    pub prompt: Vec<u32>,
    /// llama.cpp's greedy tokens after the prompt.
    pub continuation: Vec<u32>,
    /// llama.cpp's 20 largest logits after the prompt: (token, logit).
    pub top20: Vec<(u32, f32)>,
}

/// The golden of model `name`: the model's file and the cases.
pub struct LlamaCppGolden {
    pub file: PathBuf,
    pub cases: Vec<Case>,
}

impl LlamaCppGolden {
    pub fn open(name: &str) -> LlamaCppGolden {
        let g = read_json(&goldens().join("llamacpp").join(format!("{name}.json")));
        let file = model_file(&format!("{name}/{}", g["file"].as_str().unwrap()), name);
        let cases = g["cases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| Case {
                name: c["name"].as_str().unwrap().to_string(),
                gaps: c["continuation_top2_gaps"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|g| g.as_f64().unwrap())
                    .collect(),
                prompt: ids_of(&c["prompt_ids"]),
                continuation: ids_of(&c["continuation_ids"]),
                top20: c["first_step_top20"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                    .collect(),
            })
            .collect();
        LlamaCppGolden { file, cases }
    }

    /// The model on `backend`, loaded straight from its GGUF.
    pub fn decoder<B: Backend>(&self, backend: B) -> Decoder<B> {
        let gguf = wick_gguf::GgufFile::open(&self.file).unwrap();
        let cfg =
            ModelConfig::from_gguf(gguf.metadata(), &self.file.display().to_string()).unwrap();
        Decoder::load(backend, cfg, &GgufWeights::new(&gguf)).unwrap()
    }
}
