//! Qwen 3.5 (gated DeltaNet + full attention) tiny random models against transformers
//! (made by scripts/goldens/hf_tiny_qwen35.py): every position within 1e-4, the chunked
//! prefill across chunk boundaries, incremental decode, batching, greedy, and the
//! recurrent cache's exact-boundary snapshots.
mod common;

use common::golden::{golden_dir, CpuGolden};
use common::logits::{assert_near, forward_all, greedy_decode, model_pass, pass};
use common::serving::{assert_replies, pool, run_alone};
use wick_engine::backend::candle::KvDtype;
use wick_engine::models::decoder::LogitsRequest;
use wick_engine::{LoadOptions, Model};

const VARIANTS: [&str; 2] = ["qwen35", "qwen35_tied"];

fn load(variant: &str) -> CpuGolden {
    let g = CpuGolden::load(variant);
    assert!(g.model.config().qwen35.is_some());
    g
}

#[test]
fn every_position_matches_transformers() {
    for variant in VARIANTS {
        let g = load(variant);
        for case in ["len1", "len7", "len40", "pair_a", "pair_b", "len150"] {
            let ids = g.case_ids(case);
            let mut cache = g.model.new_cache();
            let got = pass(&g.model, &ids, &mut cache, LogitsRequest::All)
                .unwrap()
                .data;
            assert_near(variant, case, &got, &g.expected(case));
            assert_eq!(cache.len(), ids.len());
        }
    }
}

#[test]
fn incremental_decoding_matches_one_shot() {
    // Chunks that straddle the DeltaNet's 64-token chunk, then single tokens (the
    // recurrent form) and a long tail.
    for variant in VARIANTS {
        let g = load(variant);
        let ids = g.case_ids("len150");
        let got = forward_all(&g.model, &ids, &[5, 70, 1, 1, 1, 3, 69]);
        assert_near(variant, "len150 incremental", &got, &g.expected("len150"));
    }
}

#[test]
fn batched_sequences_match_single_runs() {
    for variant in VARIANTS {
        load(variant).batched_pair_matches_single_runs(variant, LogitsRequest::All);
    }
}

#[test]
fn greedy_continuation_matches_generate() {
    for variant in VARIANTS {
        let g = load(variant);
        let (prompt, want) = g.greedy();
        let got = greedy_decode(&g.model, &prompt, want.len());
        assert_eq!(got, want, "{variant} greedy continuation");
    }
}

#[test]
fn the_recurrent_cache_is_reused_only_at_its_exact_boundary() {
    let g = load("qwen35");
    let ids = g.case_ids("len150");
    let want = g.expected("len150");
    let vocab = g.model.config().vocab_size;
    let mut cache = g.model.new_cache();
    pass(&g.model, &ids[..100], &mut cache, LogitsRequest::None);
    // The DeltaNet state summarizes all 100 tokens: no shorter prefix can be cut out.
    assert!(cache.can_trim_to(100));
    assert!(!cache.can_trim_to(99) && !cache.can_trim_to(0));
    assert!(cache.trim(64).is_err());
    assert_eq!(cache.len(), 100);
    assert!(cache.byte_size() > 0);

    // A snapshot restored through host copies continues exactly like the live cache and
    // like the one-shot reference.
    let kv = cache.snapshot();
    let rec = cache.recurrent().unwrap().snapshot();
    let mut restored = g.model.cache_from_snapshots(&kv, Some(&rec)).unwrap();
    let live = pass(&g.model, &ids[100..], &mut cache, LogitsRequest::All)
        .unwrap()
        .data;
    let again = pass(&g.model, &ids[100..], &mut restored, LogitsRequest::All)
        .unwrap()
        .data;
    assert_eq!(live, again);
    assert_near("qwen35", "after restore", &again, &want[100 * vocab..]);

    // Snapshots that do not fit are refused, not run.
    assert!(g.model.cache_from_snapshot(&kv).is_err());
    let mut short = rec.clone();
    short.len = 99;
    assert!(g.model.cache_from_snapshots(&kv, Some(&short)).is_err());
    let mut fewer = rec.clone();
    fewer.layers.pop();
    assert!(g.model.cache_from_snapshots(&kv, Some(&fewer)).is_err());
}

#[test]
fn the_ssd_tier_stores_recurrent_state_and_serves_only_exact_boundaries() {
    use wick_cache::ssd::{SsdConfig, SsdTier};
    use wick_cache::{CacheValue, ValueLoader};

    let model = Model::load(&golden_dir("qwen35"), &LoadOptions::default()).unwrap();
    let g = load("qwen35");
    let ids = g.case_ids("len150");
    let mut live = model.new_cache();
    model_pass(&model, &ids[..100], &mut live, LogitsRequest::None);
    assert!(CacheValue::can_trim_to(&live, 100) && !CacheValue::can_trim_to(&live, 99));
    let host = live.to_host().unwrap();
    assert_eq!(host.recurrent.len(), 3, "one state per DeltaNet layer");
    assert_eq!(host.len(), 100);

    let root = tempfile::tempdir().unwrap();
    let cfg = SsdConfig {
        root: root.path().to_path_buf(),
        fingerprint: model.fingerprint(),
        model: "qwen35".into(),
        max_bytes: 0,
        verify: true,
    };
    {
        let (tier, _) = SsdTier::open(cfg.clone()).unwrap();
        tier.store("", &ids[..100], &host, None).unwrap();
    }
    // After a restart: a longer prompt restores the state; the same prompt (which must
    // forward at least one token) and a prompt diverging inside it find nothing.
    let (tier, report) = SsdTier::open(cfg).unwrap();
    assert_eq!(report.entries, 1);
    let m = tier
        .find("", &ids)
        .expect("a longer prompt extends the entry");
    assert_eq!(m.usable, 100);
    assert!(tier.find("", &ids[..100]).is_none());
    let mut diverging = ids[..120].to_vec();
    diverging[60] = (diverging[60] + 1) % 512;
    assert!(tier.find("", &diverging).is_none());

    let mut restored = model.load(tier.load(&m).unwrap()).unwrap();
    let a = model_pass(&model, &ids[100..], &mut live, LogitsRequest::All).unwrap();
    let b = model_pass(&model, &ids[100..], &mut restored, LogitsRequest::All).unwrap();
    assert_eq!(a, b, "a restored state continues exactly like the live one");
    let vocab = g.model.config().vocab_size;
    assert_near(
        "qwen35",
        "after SSD restore",
        &b.data,
        &g.expected("len150")[100 * vocab..],
    );
}

#[test]
fn batched_and_preempted_rows_equal_single_runs() {
    use std::sync::Arc;
    use std::time::Duration;
    use wick_engine::scheduler::{Engine, EngineConfig};
    use wick_engine::{GenerationRequest, LoadOptions, Model};

    let model = Arc::new(Model::load(&golden_dir("qwen35"), &LoadOptions::default()).unwrap());
    let g = load("qwen35");
    let long = g.case_ids("len150");
    let requests: Vec<GenerationRequest> = [10usize, 150, 40, 120, 70, 25]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut r = GenerationRequest::new(long[..n].to_vec()).max_tokens(20 + 3 * i);
            r.ignore_eos = true;
            r
        })
        .collect();
    let alone = run_alone(&model, &requests);
    let longest = requests
        .iter()
        .map(|r| r.prompt.len() + r.max_tokens)
        .max()
        .unwrap();
    // The one full-attention layer keeps KV: room for about two of the longest sequences.
    let blocks = 2 * longest.div_ceil(16) + 1;
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            max_batch: 6,
            step_token_budget: 48,
            prompt_cache_bytes: 0,
            kv_budget: pool(&model, blocks),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert!(engine.max_sequence_tokens() >= longest);
    assert_replies(&engine, &requests, &alone, "pool that preempts");
    let stats = engine.stats();
    assert!(
        stats.preemptions > 0,
        "the pool was meant to force preemption: {stats:?}"
    );
    assert_eq!(stats.kv_pool.used_blocks, 0, "blocks leaked: {stats:?}");
    assert!(engine.shutdown(Duration::from_secs(5)));
}

/// The golden converted by llama.cpp's `convert_hf_to_gguf.py` (scripts/goldens/gguf_qwen35.py)
/// holds the same numbers in llama.cpp's layout — value heads tiled, `-exp(A_log)`, `1 + w`
/// norms, renamed DeltaNet tensors: loaded from it, every position matches transformers as
/// the safetensors directory does.
#[test]
fn a_llama_cpp_gguf_of_the_golden_matches_transformers() {
    let g = load("qwen35");
    let path = common::golden::goldens().join("gguf/qwen35-f32.gguf");
    let opts = LoadOptions {
        kv_dtype: Some(KvDtype::F32),
        ..LoadOptions::default()
    };
    let model = Model::load(&path, &opts).unwrap();
    assert!(model.config().qwen35.is_some());
    for case in ["len1", "len7", "len40", "len150"] {
        let ids = g.case_ids(case);
        let mut cache = model.new_cache();
        let got = model_pass(&model, &ids, &mut cache, LogitsRequest::All)
            .unwrap()
            .data;
        assert_near("qwen35 gguf", case, &got, &g.expected(case));
    }
}

/// A file converted with its multi-token-prediction block counts it in `block_count` and
/// says so in `nextn_predict_layers` (llama.cpp's converter without `--no-mtp`): wick decodes
/// with the model's layers alone, to the same logits.
#[test]
fn a_gguf_counting_a_prediction_block_decodes_with_the_models_layers() {
    use wick_gguf::{GgufFile, GgufWriter, MetadataValue as V};
    let g = load("qwen35");
    let file = GgufFile::open(common::golden::goldens().join("gguf/qwen35-f32.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata().entries() {
        let v = match k.as_str() {
            "qwen35.block_count" => V::U32(5),
            "qwen35.attention.recurrent_layers" => {
                let mut layers = v.as_array().unwrap().to_vec();
                layers.push(V::Bool(false));
                V::Array(layers)
            }
            _ => v.clone(),
        };
        w.metadata(k.clone(), v);
    }
    w.metadata("qwen35.nextn_predict_layers", V::U32(1));
    for t in file.tensors() {
        let data = file.tensor(&t.name).unwrap().data.to_vec();
        w.tensor(t.name.clone(), t.dims.clone(), t.dtype, data);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qwen35-mtp.gguf");
    std::fs::write(&path, w.to_bytes()).unwrap();
    let opts = LoadOptions {
        kv_dtype: Some(KvDtype::F32),
        ..LoadOptions::default()
    };
    let model = Model::load(&path, &opts).unwrap();
    assert_eq!(model.config().num_layers, 4);
    let ids = g.case_ids("len40");
    let got = model_pass(&model, &ids, &mut model.new_cache(), LogitsRequest::All)
        .unwrap()
        .data;
    assert_near(
        "qwen35 gguf with a prediction block",
        "len40",
        &got,
        &g.expected("len40"),
    );
}
