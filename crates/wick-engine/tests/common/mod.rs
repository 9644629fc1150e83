//! What the media goldens' tests share (`hf_gemma3_vision`, `hf_gemma4_vision`,
//! `hf_gemma4_audio`, `hf_qwen_vision`): a golden directory is a tiny random model made by
//! a script in `scripts/goldens/`, its `reference.json` (cases with token ids and media
//! spans, the greedy continuation) and `logits.safetensors` (transformers' f32 logits at
//! every position of each case, and the preprocessed media). Each test file says how its
//! cases' media are built ([`Cases::media`]); the passes and comparisons are these.
#![allow(dead_code)] // each test crate uses its own subset

use std::path::{Path, PathBuf};

use wick_engine::media::MediaSpan;
use wick_engine::models::decoder::{LogitsRequest, Want};
use wick_engine::scheduler::{EngineEvent, EngineHandle};
use wick_engine::weights::SafetensorsWeights;
use wick_engine::{GenerationRequest, KvCache, LoadOptions, Model, Step};

/// Largest difference from transformers' f32 logits the goldens allow.
pub const TOLERANCE: f32 = 1e-4;

/// The directory of golden `name`. `WICK_GOLDENS` names the goldens folder when a test
/// binary runs away from its checkout (the CUDA tests on a GPU machine).
pub fn golden_dir(name: &str) -> PathBuf {
    std::env::var_os("WICK_GOLDENS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens"))
        .join("hf")
        .join(name)
}

/// A text golden of hf_reference (one tiny model per architecture): its cases' token ids
/// and transformers' f32 logits at every position of each.
pub struct TextGolden {
    pub dir: PathBuf,
    pub reference: serde_json::Value,
    pub logits: SafetensorsWeights,
}

impl TextGolden {
    pub fn open(name: &str) -> TextGolden {
        let dir = golden_dir(name);
        TextGolden {
            reference: serde_json::from_str(
                &std::fs::read_to_string(dir.join("reference.json")).unwrap(),
            )
            .unwrap(),
            logits: SafetensorsWeights::open_files(&dir, &[dir.join("logits.safetensors")])
                .unwrap(),
            dir,
        }
    }

    /// The golden's model on backend `be`, loaded straight from its safetensors.
    pub fn decoder<B: wick_engine::backend::Backend>(
        &self,
        be: B,
    ) -> wick_engine::models::decoder::Decoder<B> {
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
        case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    }

    /// transformers' logits of case `name`, every position.
    pub fn expected(&self, name: &str) -> Vec<f32> {
        floats(&self.logits, &format!("{name}.logits"))
    }
}

/// The model of a Hugging Face directory (`config.json`, `model.safetensors`) on `be`.
pub fn decoder_from_dir<B: wick_engine::backend::Backend>(
    be: B,
    d: &Path,
) -> wick_engine::models::decoder::Decoder<B> {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    let cfg = wick_engine::config::ModelConfig::from_hf(&config, &d.display().to_string()).unwrap();
    let weights = SafetensorsWeights::open_files(d, &[d.join("model.safetensors")]).unwrap();
    let quantization = wick_engine::weights::MlxQuantization::from_config(&config, "test").unwrap();
    wick_engine::models::decoder::Decoder::load(
        be,
        cfg.clone(),
        &weights
            .canonical_as(cfg.features.hf_naming)
            .with_quantization(quantization),
    )
    .unwrap()
}

/// Writes into `dir` a random-weight two-layer Qwen 3 model (the qwen3 golden's config
/// with `heads` query heads over `kv_heads` KV heads of `head_dim` dimensions, hidden size
/// 64, vocabulary 512): attention shapes of real models (head size 128 or 256, 1–32 query
/// heads per KV head) that the tiny goldens do not have. Weights are uniform with unit
/// output variance, seeded by the shape.
pub fn write_wide_model(dir: &Path, heads: usize, kv_heads: usize, head_dim: usize) {
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(golden_dir("qwen3").join("config.json")).unwrap(),
    )
    .unwrap();
    config["num_attention_heads"] = heads.into();
    config["num_key_value_heads"] = kv_heads.into();
    config["head_dim"] = head_dim.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let (hidden, ffn, vocab) = (64usize, 128usize, 512usize);
    let mut tensors: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, hidden]),
        ("model.norm.weight".into(), vec![hidden]),
    ];
    for l in 0..2 {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![hidden]),
            ("post_attention_layernorm.weight", vec![hidden]),
            ("self_attn.q_proj.weight", vec![heads * head_dim, hidden]),
            ("self_attn.k_proj.weight", vec![kv_heads * head_dim, hidden]),
            ("self_attn.v_proj.weight", vec![kv_heads * head_dim, hidden]),
            ("self_attn.o_proj.weight", vec![hidden, heads * head_dim]),
            ("self_attn.q_norm.weight", vec![head_dim]),
            ("self_attn.k_norm.weight", vec![head_dim]),
            ("mlp.gate_proj.weight", vec![ffn, hidden]),
            ("mlp.up_proj.weight", vec![ffn, hidden]),
            ("mlp.down_proj.weight", vec![hidden, ffn]),
        ] {
            tensors.push((format!("{p}.{name}"), shape));
        }
    }
    let mut state = (heads * 1_000_003 + kv_heads * 1_009 + head_dim) as u64 | 1;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
    };
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape) in &tensors {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = if shape.len() == 1 {
            (0..n).map(|_| 1.0 + 0.1 * uniform()).collect()
        } else {
            let a = if name.contains("embed") {
                1.0
            } else {
                (3.0 / shape[1] as f32).sqrt()
            };
            (0..n).map(|_| a * uniform()).collect()
        };
        let at = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, data.len()]}),
        );
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

/// Rewrites the f32 `model.safetensors` of `dir` (as [`write_wide_model`] leaves it) in
/// MLX's affine layout, as `mlx_lm.convert -q` does: every matrix packed at `bits` with
/// scales and biases of type `side` per `group` inputs, and `quantization` in
/// `config.json`.
pub fn quantize_model(dir: &Path, bits: u32, group: usize, side: wick_gguf::GgmlType) {
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut out: Vec<(String, String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, info) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        assert_eq!(info["dtype"], "F32", "{name}");
        let shape: Vec<usize> = serde_json::from_value(info["shape"].clone()).unwrap();
        let [a, b] = [0, 1].map(|i| info["data_offsets"][i].as_u64().unwrap() as usize);
        let raw = &bytes[8 + n + a..8 + n + b];
        let values: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let [rows, cols] = shape[..] else {
            out.push((name.clone(), "F32".into(), shape, raw.to_vec()));
            continue;
        };
        let q = wick_engine::weights::AffineWeight::quantize(
            name,
            &values,
            (rows, cols),
            (bits, group),
            side,
        )
        .unwrap();
        let module = name.strip_suffix(".weight").unwrap();
        let words = cols * bits as usize / 32;
        out.push((
            name.clone(),
            "U32".into(),
            vec![rows, words],
            q.packed.to_vec(),
        ));
        for (side, w) in [("scales", &q.scales), ("biases", &q.biases)] {
            out.push((
                format!("{module}.{side}"),
                w.dtype.to_string(),
                w.shape.clone(),
                w.bytes.to_vec(),
            ));
        }
    }
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, b) in out {
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
    std::fs::write(&file, bytes).unwrap();
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["quantization"] = serde_json::json!({"group_size": group, "bits": bits});
    std::fs::write(&path, config.to_string()).unwrap();
}

/// The attention shapes [`write_wide_model`] is used with: (query heads, KV heads, head
/// size) — Llama-3-like groups of 4 at 128, a group of 7 at 64 (Qwen2.5-0.5B), MHA,
/// groups of 8 and 32 at 128, Gemma's 256.
pub const WIDE_SHAPES: [(usize, usize, usize); 6] = [
    (8, 2, 128),
    (14, 2, 64),
    (4, 4, 128),
    (16, 2, 128),
    (32, 1, 128),
    (8, 2, 256),
];

/// Logits of every position of `ids`, fed in pieces of `chunks` (cycled) through one cache.
pub fn forward_all<B: wick_engine::backend::Backend>(
    m: &wick_engine::models::decoder::Decoder<B>,
    ids: &[u32],
    chunks: &[usize],
) -> Vec<f32> {
    let mut cache = m.new_cache();
    let mut got = Vec::new();
    let mut at = 0;
    for &c in chunks.iter().cycle() {
        if at >= ids.len() {
            break;
        }
        let end = (at + c).min(ids.len());
        let out = m
            .forward_logits(&mut [wick_engine::models::decoder::BatchItem::new(
                &ids[at..end],
                &mut cache,
                Want::logits(LogitsRequest::All),
            )])
            .unwrap();
        got.extend_from_slice(&out[0].as_ref().unwrap().data);
        at = end;
    }
    got
}

/// One pass over several sequences batched (tokens, cache, which logits): each
/// sequence's logits.
pub fn forward_batch<B: wick_engine::backend::Backend>(
    m: &wick_engine::models::decoder::Decoder<B>,
    seqs: Vec<(
        &[u32],
        &mut wick_engine::models::decoder::SequenceCache<B>,
        LogitsRequest,
    )>,
) -> Vec<Vec<f32>> {
    let mut items: Vec<_> = seqs
        .into_iter()
        .map(|(tokens, cache, logits)| {
            wick_engine::models::decoder::BatchItem::new(tokens, cache, Want::logits(logits))
        })
        .collect();
    m.forward_logits(&mut items)
        .unwrap()
        .into_iter()
        .map(|o| o.unwrap().data)
        .collect()
}

/// Token ids below 512 (the wide models' vocabulary), seeded.
pub fn some_ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503))
                >> 7)
                % 512
        })
        .collect()
}

/// The model, `reference.json` and `logits.safetensors` of a golden directory.
pub fn load_parts(dir: &Path) -> (Model, serde_json::Value, SafetensorsWeights) {
    (
        Model::load(dir, &LoadOptions::default()).unwrap(),
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap(),
        SafetensorsWeights::open_files(dir, &[dir.join("logits.safetensors")]).unwrap(),
    )
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

/// Fails unless every value of `got` is within [`TOLERANCE`] of `want` (and prints the
/// largest difference, which the closing notes quote).
pub fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (i, diff) = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold((0, 0f32), |m, (i, d)| if d > m.1 { (i, d) } else { m });
    eprintln!("{what}: max |diff| {diff}");
    assert!(
        diff <= TOLERANCE,
        "{what}: max |diff| {diff} at {i} ({} vs {})",
        got[i],
        want[i]
    );
}

/// A request through the engine to its end: the generated ids and the prompt tokens the
/// prompt cache served.
pub fn collect(engine: &EngineHandle, req: GenerationRequest) -> (Vec<u32>, usize) {
    let mut h = engine.submit(req).unwrap();
    let mut ids = Vec::new();
    while let Some(e) = h.blocking_next() {
        match e {
            EngineEvent::Token(t) => ids.push(t.id),
            EngineEvent::Done(d) => return (ids, d.usage.cached_tokens),
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
        }
    }
    panic!("channel closed without Done");
}

/// A golden's cases, and the passes every media test runs over them.
pub trait Cases {
    /// The loaded model.
    fn model(&self) -> &Model;
    /// `reference.json`.
    fn reference(&self) -> &serde_json::Value;
    /// `logits.safetensors`.
    fn logits(&self) -> &SafetensorsWeights;
    /// The media spans of case `name`, as the server would attach them.
    fn media(&self, name: &str) -> Vec<MediaSpan>;

    /// Case `name` of the reference.
    fn case(&self, name: &str) -> &serde_json::Value {
        self.reference()["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()
    }

    /// The prompt ids of case `name`.
    fn ids(&self, name: &str) -> Vec<u32> {
        self.case(name)["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    }

    /// transformers' logits at every position of case `name`.
    fn expected(&self, name: &str) -> Vec<f32> {
        floats(self.logits(), &format!("{name}.logits"))
    }

    /// Every position's logits with the prompt of case `name` fed in passes of at most
    /// `chunk` tokens, each moved so that it cuts no media item.
    fn chunked(&self, name: &str, chunk: usize) -> Vec<f32> {
        let ids = self.ids(name);
        let mut cache = self.model().new_cache();
        self.model()
            .attach_media(&mut cache, &self.media(name))
            .unwrap();
        let mut out = Vec::new();
        let mut at = 0;
        while at < ids.len() {
            let end = cache.chunk_end(at, (at + chunk).min(ids.len()));
            out.extend(self.pass(&ids[at..end], &mut cache));
            at = end;
        }
        out
    }

    /// One forward pass of `tokens` on `cache`: logits at every position.
    fn pass(&self, tokens: &[u32], cache: &mut KvCache) -> Vec<f32> {
        let mut steps = [Step {
            tokens,
            cache,
            logits: LogitsRequest::All,
        }];
        let out = self.model().forward(&mut steps).unwrap();
        out.into_iter().next().unwrap().unwrap().data
    }

    /// Case `media_case` prefilled in one batch beside the text-only case `text_case`: both
    /// rows' logits at every position match transformers'; then the two rows decode a
    /// token together, the media row like any other.
    fn batch_beside_text(&self, what: &str, media_case: &str, text_case: &str) {
        let (a, b) = (self.ids(media_case), self.ids(text_case));
        let model = self.model();
        let mut ca = model.new_cache();
        model
            .attach_media(&mut ca, &self.media(media_case))
            .unwrap();
        let mut cb = model.new_cache();
        let mut steps = [
            Step {
                tokens: &b,
                cache: &mut cb,
                logits: LogitsRequest::All,
            },
            Step {
                tokens: &a,
                cache: &mut ca,
                logits: LogitsRequest::All,
            },
        ];
        let out = model.forward(&mut steps).unwrap();
        let row = |i: usize| &out[i].as_ref().unwrap().data;
        assert_close(
            &format!("{what} text row"),
            row(0),
            &self.expected(text_case),
        );
        assert_close(
            &format!("{what} media row"),
            row(1),
            &self.expected(media_case),
        );
        let mut steps = [
            Step {
                tokens: &[10],
                cache: &mut cb,
                logits: LogitsRequest::Last,
            },
            Step {
                tokens: &[10],
                cache: &mut ca,
                logits: LogitsRequest::Last,
            },
        ];
        for out in model.forward(&mut steps).unwrap() {
            assert!(
                out.unwrap().data.iter().all(|v| v.is_finite()),
                "{what}: decode"
            );
        }
    }

    /// Case `name` run step by step with the sequence preempted once inside its prompt
    /// (prefilled `chunk` tokens at a time) and once while decoding: the recomputed reply
    /// equals the uninterrupted one.
    fn preempted_reply_is_unchanged(&self, name: &str, chunk: usize) {
        let model = self.model();
        let mut req = self.request(name, 12);
        req.prefill_chunk = chunk;
        let cold = model
            .generate(&req, |_| std::ops::ControlFlow::Continue(()))
            .unwrap()
            .tokens;
        let mut seq = wick_engine::Sequence::new(model, &req, model.new_cache()).unwrap();
        let mut steps = 0;
        while !seq.is_finished() {
            if steps == 3 || steps == 12 {
                seq.preempt(model.new_cache());
            }
            steps += 1;
            let step = seq.next_step(req.prefill_chunk);
            let out = {
                let (tokens, cache) = seq.input_and_cache(&step);
                model
                    .forward(&mut [Step {
                        tokens: &tokens,
                        cache,
                        logits: step.logits,
                    }])
                    .unwrap()
            };
            seq.advance(
                &step,
                out.into_iter().next().flatten(),
                std::time::Duration::ZERO,
            )
            .unwrap();
        }
        assert_eq!(seq.preemptions(), 2);
        assert_eq!(seq.finish().tokens, cold);
    }

    /// Case `name` as a generation request of `max_tokens` (end of sequence ignored).
    fn request(&self, name: &str, max_tokens: usize) -> GenerationRequest {
        let mut req = GenerationRequest::new(self.ids(name)).max_tokens(max_tokens);
        req.media = self.media(name);
        req.ignore_eos = true;
        req
    }
}
