//! Qwen 3.5 (gated DeltaNet + full attention) tiny random models against transformers
//! (made by scripts/goldens/hf_tiny_qwen35.py): every position within 1e-4, the chunked
//! prefill across chunk boundaries, incremental decode, batching, greedy, and the
//! recurrent cache's exact-boundary snapshots.
use std::path::{Path, PathBuf};

use wick_engine::backend::candle::CandleBackend;
use wick_engine::config::ModelConfig;
use wick_engine::models::decoder::{BatchItem, Decoder, LogitsRequest, SequenceCache, Want};
use wick_engine::weights::SafetensorsWeights;

const VARIANTS: [&str; 2] = ["qwen35", "qwen35_tied"];
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

fn load(variant: &str) -> Golden {
    let d = dir(variant);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    let cfg = ModelConfig::from_hf(&config, &d.display().to_string()).unwrap();
    assert!(cfg.qwen35.is_some());
    let weights = SafetensorsWeights::open_files(&d, &[d.join("model.safetensors")]).unwrap();
    let model = Decoder::load(CandleBackend::cpu(), cfg, &weights.canonical(false)).unwrap();
    let reference =
        serde_json::from_str(&std::fs::read_to_string(d.join("reference.json")).unwrap()).unwrap();
    let logits = SafetensorsWeights::open_files(&d, &[d.join("logits.safetensors")]).unwrap();
    Golden {
        model,
        reference,
        logits,
    }
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

    fn run(
        &self,
        tokens: &[u32],
        cache: &mut SequenceCache<CandleBackend>,
        logits: LogitsRequest,
    ) -> Vec<f32> {
        let out = self
            .model
            .forward_logits(&mut [BatchItem::new(tokens, cache, Want::logits(logits))])
            .unwrap();
        out[0].as_ref().map(|l| l.data.clone()).unwrap_or_default()
    }
}

fn assert_close(variant: &str, what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{variant} {what}: length");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= TOLERANCE * scale,
        "{variant} {what}: max |diff| {worst} > {TOLERANCE} × {scale}"
    );
}

#[test]
fn every_position_matches_transformers() {
    for variant in VARIANTS {
        let g = load(variant);
        for case in ["len1", "len7", "len40", "pair_a", "pair_b", "len150"] {
            let ids = g.case_ids(case);
            let mut cache = g.model.new_cache();
            let got = g.run(&ids, &mut cache, LogitsRequest::All);
            assert_close(variant, case, &got, &g.expected(case));
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
        let mut cache = g.model.new_cache();
        let mut got = Vec::new();
        let mut at = 0;
        for chunk in [5usize, 70, 1, 1, 1, 3, 69] {
            let end = (at + chunk).min(ids.len());
            got.extend(g.run(&ids[at..end], &mut cache, LogitsRequest::All));
            at = end;
        }
        assert_eq!(at, ids.len());
        assert_close(variant, "len150 incremental", &got, &g.expected("len150"));
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
                BatchItem::new(&b, &mut cb, Want::logits(LogitsRequest::All)),
            ])
            .unwrap();
        assert_close(
            variant,
            "pair_a batched",
            &out[0].as_ref().unwrap().data,
            &g.expected("pair_a"),
        );
        assert_close(
            variant,
            "pair_b batched",
            &out[1].as_ref().unwrap().data,
            &g.expected("pair_b"),
        );
        // One decode step of both at once, against each sequence alone.
        let step = g
            .model
            .forward_logits(&mut [
                BatchItem::new(&[a[0]], &mut ca, Want::logits(LogitsRequest::Last)),
                BatchItem::new(&[b[0]], &mut cb, Want::logits(LogitsRequest::Last)),
            ])
            .unwrap();
        for (seq, got) in [(&a, &step[0]), (&b, &step[1])] {
            let mut ids = seq.clone();
            ids.push(seq[0]);
            let mut c = g.model.new_cache();
            let alone = g.run(&ids, &mut c, LogitsRequest::Last);
            assert_close(
                variant,
                "batched decode step",
                &got.as_ref().unwrap().data,
                &alone,
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
            let row = g.run(&next, &mut cache, LogitsRequest::Last);
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
fn the_recurrent_cache_is_reused_only_at_its_exact_boundary() {
    let g = load("qwen35");
    let ids = g.case_ids("len150");
    let want = g.expected("len150");
    let vocab = g.model.config().vocab_size;
    let mut cache = g.model.new_cache();
    g.run(&ids[..100], &mut cache, LogitsRequest::None);
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
    let live = g.run(&ids[100..], &mut cache, LogitsRequest::All);
    let again = g.run(&ids[100..], &mut restored, LogitsRequest::All);
    assert_eq!(live, again);
    assert_close("qwen35", "after restore", &again, &want[100 * vocab..]);

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
    use wick_engine::{LoadOptions, Model, Step};

    let model = Model::load(&dir("qwen35"), &LoadOptions::default()).unwrap();
    let g = load("qwen35");
    let ids = g.case_ids("len150");
    let run = |cache: &mut wick_engine::KvCache, tokens: &[u32], logits| {
        model
            .forward(&mut [Step {
                tokens,
                cache,
                logits,
            }])
            .unwrap()
            .remove(0)
    };
    let mut live = model.new_cache();
    run(&mut live, &ids[..100], LogitsRequest::None);
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
    let a = run(&mut live, &ids[100..], LogitsRequest::All).unwrap();
    let b = run(&mut restored, &ids[100..], LogitsRequest::All).unwrap();
    assert_eq!(a, b, "a restored state continues exactly like the live one");
    let vocab = g.model.config().vocab_size;
    assert_close(
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
    use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent, KvBudget};
    use wick_engine::{GenerationRequest, LoadOptions, Model};

    let model = Arc::new(Model::load(&dir("qwen35"), &LoadOptions::default()).unwrap());
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
    let alone: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| {
            model
                .generate(r, |_| std::ops::ControlFlow::Continue(()))
                .unwrap()
                .tokens
        })
        .collect();
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
            kv_budget: KvBudget::Bytes((blocks * model.kv_block_bytes()) as u64),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert!(engine.max_sequence_tokens() >= longest);
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    for (i, (mut h, want)) in handles.into_iter().zip(&alone).enumerate() {
        let mut ids = Vec::new();
        while let Some(e) = h.blocking_next() {
            match e {
                EngineEvent::Token(t) => ids.push(t.id),
                EngineEvent::Done(_) => break,
                EngineEvent::Failed(e) => panic!("request {i} failed: {e}"),
            }
        }
        assert_eq!(&ids, want, "request {i} differs from its single run");
    }
    let stats = engine.stats();
    assert!(
        stats.preemptions > 0,
        "the pool was meant to force preemption: {stats:?}"
    );
    assert_eq!(stats.kv_pool.used_blocks, 0, "blocks leaked: {stats:?}");
    assert!(engine.shutdown(Duration::from_secs(5)));
}
