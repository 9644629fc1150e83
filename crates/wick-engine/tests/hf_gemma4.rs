//! Gemma 4 (tiny random models made by scripts/goldens/hf_tiny_gemma4.py) against
//! transformers' f32 logits: every position, chunked prefill and decoding through the KV
//! cache (sliding windows, KV sharing), batches of sequences of different lengths, trimming
//! and snapshots, and the greedy continuation of `generate()`.
use std::path::{Path, PathBuf};

use wick_engine::backend::candle::CandleBackend;
use wick_engine::config::ModelConfig;
use wick_engine::models::decoder::{BatchItem, Decoder, LogitsRequest, Want};
use wick_engine::weights::SafetensorsWeights;

/// `gemma4`: e2b shape (PLE, KV sharing, proportional RoPE); `gemma4_moe`: 26B-A4B shape.
const VARIANTS: [&str; 2] = ["gemma4", "gemma4_moe"];
const TOLERANCE: f32 = 1e-4;

fn dir(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/goldens/hf")
        .join(variant)
}

struct Golden {
    model: Decoder<CandleBackend>,
    reference: serde_json::Value,
    logits: SafetensorsWeights,
}

fn config(variant: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir(variant).join("config.json")).unwrap())
        .unwrap()
}

fn load_with(variant: &str, config: &serde_json::Value) -> Golden {
    let d = dir(variant);
    let cfg = ModelConfig::from_hf(config, &d.display().to_string()).unwrap();
    let weights = SafetensorsWeights::open_files(&d, &[d.join("model.safetensors")]).unwrap();
    let model = Decoder::load(CandleBackend::cpu(), cfg, &weights.canonical(true)).unwrap();
    let reference =
        serde_json::from_str(&std::fs::read_to_string(d.join("reference.json")).unwrap()).unwrap();
    let logits = SafetensorsWeights::open_files(&d, &[d.join("logits.safetensors")]).unwrap();
    Golden {
        model,
        reference,
        logits,
    }
}

fn load(variant: &str) -> Golden {
    load_with(variant, &config(variant))
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

impl Golden {
    fn case_ids(&self, name: &str) -> Vec<u32> {
        let case = self.reference["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        ids_of(&case["ids"])
    }

    fn expected(&self, name: &str) -> Vec<f32> {
        let w = self.logits.raw(&format!("{name}.logits")).unwrap();
        w.bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn all(&self, ids: &[u32]) -> Vec<f32> {
        let mut cache = self.model.new_cache();
        let out = self
            .model
            .forward_logits(&mut [BatchItem::new(
                ids,
                &mut cache,
                Want::logits(LogitsRequest::All),
            )])
            .unwrap();
        out[0].as_ref().unwrap().data.clone()
    }
}

fn worst(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "length");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    (worst, scale)
}

fn assert_close(variant: &str, what: &str, got: &[f32], want: &[f32]) {
    let (worst, scale) = worst(got, want);
    assert!(
        worst <= TOLERANCE * scale,
        "{variant} {what}: max |diff| {worst} > {TOLERANCE} × {scale}"
    );
}

#[test]
fn every_position_matches_transformers() {
    for variant in VARIANTS {
        let g = load(variant);
        for case in ["len1", "len7", "len40", "pair_a", "pair_b"] {
            let ids = g.case_ids(case);
            assert_close(variant, case, &g.all(&ids), &g.expected(case));
        }
    }
}

#[test]
fn kv_shared_layers_keep_no_cache_of_their_own() {
    let g = load("gemma4");
    // Six layers, the last two reuse layers 3 (sliding) and 2 (full).
    let cache = g.model.new_cache();
    assert_eq!(cache.layers().len(), 4);
    let snap = cache.snapshot();
    let layout: Vec<_> = snap.iter().map(|s| (s.head_dim, s.window)).collect();
    assert_eq!(
        layout,
        vec![(16, Some(8)), (16, Some(8)), (32, None), (16, Some(8))]
    );
    assert_eq!(load("gemma4_moe").model.new_cache().layers().len(), 4);
}

#[test]
fn the_goldens_depend_on_what_the_config_says() {
    // Reading the config wrongly must show in the logits: without KV sharing the shared
    // layers would need weights the file does not have, and a wrong rotary fraction or a
    // missing soft cap moves the logits far past the tolerance.
    let mut c = config("gemma4");
    c["num_kv_shared_layers"] = 0.into();
    let d = dir("gemma4");
    let cfg = ModelConfig::from_hf(&c, "test").unwrap();
    let weights = SafetensorsWeights::open_files(&d, &[d.join("model.safetensors")]).unwrap();
    assert!(Decoder::load(CandleBackend::cpu(), cfg, &weights.canonical(true)).is_err());
    for (key, value) in [
        (
            "/rope_parameters/full_attention/partial_rotary_factor",
            serde_json::json!(1.0),
        ),
        ("/final_logit_softcapping", serde_json::Value::Null),
    ] {
        let mut c = config("gemma4");
        *c.pointer_mut(key).unwrap() = value;
        let g = load_with("gemma4", &c);
        let (w, scale) = worst(&g.all(&g.case_ids("len40")), &g.expected("len40"));
        assert!(w > 100.0 * TOLERANCE * scale, "{key}: only {w} off");
    }
}

#[test]
fn incremental_decoding_matches_one_shot() {
    // Uneven chunks, then single tokens: the sliding window drops keys while KV-shared
    // layers still read them within a chunk.
    for variant in VARIANTS {
        let g = load(variant);
        let ids = g.case_ids("len40");
        let mut cache = g.model.new_cache();
        let mut got = Vec::new();
        let mut at = 0;
        for chunk in [5usize, 3, 9, 1, 1, 1, 20] {
            let end = (at + chunk).min(ids.len());
            let out = g
                .model
                .forward_logits(&mut [BatchItem::new(
                    &ids[at..end],
                    &mut cache,
                    Want::logits(LogitsRequest::All),
                )])
                .unwrap();
            got.extend_from_slice(&out[0].as_ref().unwrap().data);
            at = end;
        }
        assert_eq!(at, ids.len());
        assert_close(variant, "len40 incremental", &got, &g.expected("len40"));
    }
}

#[test]
fn batched_sequences_match_single_runs() {
    for variant in VARIANTS {
        let g = load(variant);
        let (a, b) = (g.case_ids("pair_a"), g.case_ids("pair_b"));
        let (mut ca, mut cb) = (g.model.new_cache(), g.model.new_cache());
        let out = g
            .model
            .forward_logits(&mut [
                BatchItem::new(&a, &mut ca, Want::logits(LogitsRequest::All)),
                BatchItem::new(&b, &mut cb, Want::logits(LogitsRequest::Last)),
            ])
            .unwrap();
        assert_close(
            variant,
            "pair_a batched",
            &out[0].as_ref().unwrap().data,
            &g.expected("pair_a"),
        );
        let want_b = g.expected("pair_b");
        let vocab = g.model.config().vocab_size;
        assert_close(
            variant,
            "pair_b batched last row",
            &out[1].as_ref().unwrap().data,
            &want_b[want_b.len() - vocab..],
        );
        let (na, nb) = (a[0], b[0]);
        let step = g
            .model
            .forward_logits(&mut [
                BatchItem::new(&[na], &mut ca, Want::logits(LogitsRequest::Last)),
                BatchItem::new(&[nb], &mut cb, Want::logits(LogitsRequest::Last)),
            ])
            .unwrap();
        for (seq, next, got) in [(&a, na, &step[0]), (&b, nb, &step[1])] {
            let mut ids = seq.clone();
            ids.push(next);
            let alone = g.all(&ids);
            assert_close(
                variant,
                "batched decode step",
                &got.as_ref().unwrap().data,
                &alone[alone.len() - vocab..],
            );
        }
    }
}

#[test]
fn greedy_continuation_matches_generate() {
    for variant in VARIANTS {
        let g = load(variant);
        let greedy = &g.reference["greedy"];
        let want = ids_of(&greedy["continuation_ids"]);
        let mut cache = g.model.new_cache();
        let mut next = ids_of(&greedy["prompt_ids"]);
        let mut got = Vec::new();
        while got.len() < want.len() {
            let out = g
                .model
                .forward_logits(&mut [BatchItem::new(
                    &next,
                    &mut cache,
                    Want::logits(LogitsRequest::Last),
                )])
                .unwrap();
            let row = out[0].as_ref().unwrap().last().to_vec();
            let id = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32;
            got.push(id);
            next = vec![id];
        }
        assert_eq!(got, want, "{variant} greedy continuation");
    }
}

#[test]
fn cache_trim_and_snapshot_round_trip() {
    let g = load("gemma4");
    let ids = g.case_ids("len40");
    let mut cache = g.model.new_cache();
    g.model
        .forward_logits(&mut [BatchItem::new(
            &ids[..12],
            &mut cache,
            Want::logits(LogitsRequest::None),
        )])
        .unwrap();
    assert!(cache.can_trim_to(10));
    cache.trim(10).unwrap();
    let snapshot = cache.snapshot();
    assert_eq!(snapshot.len(), 4, "one snapshot per producing layer");
    let mut restored = g.model.cache_from_snapshot(&snapshot).unwrap();
    let a = g
        .model
        .forward_logits(&mut [BatchItem::new(
            &ids[10..],
            &mut cache,
            Want::logits(LogitsRequest::All),
        )])
        .unwrap();
    let b = g
        .model
        .forward_logits(&mut [BatchItem::new(
            &ids[10..],
            &mut restored,
            Want::logits(LogitsRequest::All),
        )])
        .unwrap();
    assert_eq!(a[0], b[0]);
    let vocab = g.model.config().vocab_size;
    assert_close(
        "gemma4",
        "after trim",
        &a[0].as_ref().unwrap().data,
        &g.expected("len40")[10 * vocab..],
    );
    // A snapshot of another layout is refused.
    let mut wrong = snapshot.clone();
    wrong.pop();
    assert!(g.model.cache_from_snapshot(&wrong).is_err());
}
