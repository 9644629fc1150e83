//! Gemma 4 (tiny random models made by scripts/goldens/hf_tiny_gemma4.py) against
//! transformers' f32 logits: every position, chunked prefill and decoding through the KV
//! cache (sliding windows, KV sharing), batches of sequences of different lengths, trimming
//! and snapshots, and the greedy continuation of `generate()`.
mod common;

use common::golden::{load_decoder, CpuGolden, TextGolden};
use common::logits::{
    assert_near, forward_all, greedy_decode, greedy_lockstep, pass, worst, TOLERANCE,
};
use wick_engine::backend::candle::CandleBackend;
use wick_engine::models::decoder::LogitsRequest;

/// `gemma4`: e2b shape (PLE, KV sharing, proportional RoPE); `gemma4_moe`: 26B-A4B shape.
const VARIANTS: [&str; 2] = ["gemma4", "gemma4_moe"];

#[test]
fn every_position_matches_transformers() {
    for variant in VARIANTS {
        let g = CpuGolden::load(variant);
        for case in ["len1", "len7", "len40", "pair_a", "pair_b"] {
            let ids = g.case_ids(case);
            assert_near(variant, case, &g.all(&ids), &g.expected(case));
        }
    }
}

#[test]
fn kv_shared_layers_keep_no_cache_of_their_own() {
    let g = CpuGolden::load("gemma4");
    // Six layers, the last two reuse layers 3 (sliding) and 2 (full).
    let cache = g.model.new_cache();
    assert_eq!(cache.layers().len(), 4);
    let snap = cache.snapshot();
    let layout: Vec<_> = snap.iter().map(|s| (s.head_dim, s.window)).collect();
    assert_eq!(
        layout,
        vec![(16, Some(8)), (16, Some(8)), (32, None), (16, Some(8))]
    );
    assert_eq!(
        CpuGolden::load("gemma4_moe")
            .model
            .new_cache()
            .layers()
            .len(),
        4
    );
}

#[test]
fn the_goldens_depend_on_what_the_config_says() {
    // Reading the config wrongly must show in the logits: without KV sharing the shared
    // layers would need weights the file does not have, and a wrong rotary fraction or a
    // missing soft cap moves the logits far past the tolerance.
    let golden = TextGolden::open("gemma4");
    let mut c = golden.config();
    c["num_kv_shared_layers"] = 0.into();
    assert!(load_decoder(CandleBackend::cpu(), &golden.dir, &c).is_err());
    for (key, value) in [
        (
            "/rope_parameters/full_attention/partial_rotary_factor",
            serde_json::json!(1.0),
        ),
        ("/final_logit_softcapping", serde_json::Value::Null),
    ] {
        let mut c = golden.config();
        *c.pointer_mut(key).unwrap() = value;
        let g = CpuGolden::load_with("gemma4", &c);
        let (w, scale) = worst(&g.all(&g.case_ids("len40")), &g.expected("len40"));
        assert!(w > 100.0 * TOLERANCE * scale, "{key}: only {w} off");
    }
}

#[test]
fn incremental_decoding_matches_one_shot() {
    // Uneven chunks, then single tokens: the sliding window drops keys while KV-shared
    // layers still read them within a chunk.
    for variant in VARIANTS {
        let g = CpuGolden::load(variant);
        let ids = g.case_ids("len40");
        let got = forward_all(&g.model, &ids, &[5, 3, 9, 1, 1, 1, 20]);
        assert_near(variant, "len40 incremental", &got, &g.expected("len40"));
    }
}

#[test]
fn batched_sequences_match_single_runs() {
    for variant in VARIANTS {
        CpuGolden::load(variant).batched_pair_matches_single_runs(variant, LogitsRequest::Last);
    }
}

#[test]
fn greedy_continuation_matches_generate() {
    for variant in VARIANTS {
        let g = CpuGolden::load(variant);
        let (prompt, want) = g.greedy();
        let got = greedy_decode(&g.model, &prompt, want.len());
        assert_eq!(got, want, "{variant} greedy continuation");
    }
}

#[test]
fn cache_trim_and_snapshot_round_trip() {
    let g = CpuGolden::load("gemma4");
    let ids = g.case_ids("len40");
    let mut cache = g.model.new_cache();
    pass(&g.model, &ids[..12], &mut cache, LogitsRequest::None);
    assert!(cache.can_trim_to(10));
    cache.trim(10).unwrap();
    let snapshot = cache.snapshot();
    assert_eq!(snapshot.len(), 4, "one snapshot per producing layer");
    let mut restored = g.model.cache_from_snapshot(&snapshot).unwrap();
    let a = pass(&g.model, &ids[10..], &mut cache, LogitsRequest::All);
    let b = pass(&g.model, &ids[10..], &mut restored, LogitsRequest::All);
    assert_eq!(a, b);
    let vocab = g.model.config().vocab_size;
    assert_near(
        "gemma4",
        "after trim",
        &a.unwrap().data,
        &g.expected("len40")[10 * vocab..],
    );
    // A snapshot of another layout is refused.
    let mut wrong = snapshot.clone();
    wrong.pop();
    assert!(g.model.cache_from_snapshot(&wrong).is_err());
}

#[test]
fn zero_padded_per_layer_config_keys_name_the_same_layers() {
    // transformers writes `per_layer_config` keys zero-padded once a model has ten layers
    // or more ("05"): the same layers must get their head sizes.
    let golden = TextGolden::open("gemma4");
    let mut c = golden.config();
    let map = c["per_layer_config"].as_object().unwrap().clone();
    let padded: serde_json::Map<String, serde_json::Value> = map
        .into_iter()
        .map(|(k, v)| (format!("{:0>2}", k), v))
        .collect();
    c["per_layer_config"] = serde_json::Value::Object(padded);
    let g = CpuGolden::load_with("gemma4", &c);
    let ids = g.case_ids("len40");
    assert_near("gemma4", "padded keys", &g.all(&ids), &g.expected("len40"));
    let mut twice = golden.config();
    twice["per_layer_config"]["02"] = twice["per_layer_config"]["2"].clone();
    let err = wick_engine::config::ModelConfig::from_hf(&twice, "twice").unwrap_err();
    assert!(err.to_string().contains("layer 2 twice"), "{err}");
}

#[test]
fn lockstep_decoding_with_backend_ids_matches_host_ids() {
    // `decode_ids` fed the last step's ids as the backend holds them (what `wick bench` and
    // greedy batches run): the per-layer inputs embed those ids without the host.
    let g = CpuGolden::load("gemma4");
    let (prompt, want) = g.greedy();
    let prompts = [prompt.clone(), g.case_ids("len7")];
    let got = greedy_lockstep(&g.model, &prompts, want.len());
    for (p, got) in prompts.iter().zip(&got) {
        assert_eq!(got, &greedy_decode(&g.model, p, want.len()));
    }
    assert_eq!(got[0], want, "transformers' continuation");
}

/// The goldens converted by llama.cpp's `convert_hf_to_gguf.py` (scripts/goldens/gguf_tiny.py):
/// per-layer arrays in the metadata, the full layers' proportional rotation as `rope_freqs`
/// divisors, `attention_k_eq_v` as layers without `attn_v` (the MoE variant), experts and PLE
/// under llama.cpp's names. Loaded from them, every position matches transformers as the
/// safetensors directory does.
#[test]
fn llama_cpp_ggufs_of_the_goldens_match_transformers() {
    use wick_engine::backend::candle::KvDtype;
    use wick_engine::{LoadOptions, Model};
    for variant in VARIANTS {
        let g = CpuGolden::load(variant);
        let path = common::golden::goldens().join(format!("gguf/{variant}-f32.gguf"));
        let opts = LoadOptions {
            kv_dtype: Some(KvDtype::F32),
            ..LoadOptions::default()
        };
        let model = Model::load(&path, &opts).unwrap();
        // The same layout as config.json gives (the PLE table's rows matter only with PLE).
        let (mut got, want) = (
            model.config().gemma4.clone().unwrap(),
            g.model.config().gemma4.clone().unwrap(),
        );
        if got.ple_dim == 0 {
            got.ple_vocab = want.ple_vocab;
        }
        assert_eq!(got, want, "{variant}");
        for case in ["len1", "len7", "len40"] {
            let ids = g.case_ids(case);
            let got = common::logits::model_pass(
                &model,
                &ids,
                &mut model.new_cache(),
                LogitsRequest::All,
            )
            .unwrap()
            .data;
            assert_near(
                variant,
                &format!("{case} from GGUF"),
                &got,
                &g.expected(case),
            );
        }
    }
}
