//! f32 logits of tiny random models against Hugging Face transformers (see
//! scripts/goldens/README.md): every architecture, the safetensors path, batching and the
//! KV cache (including Gemma's sliding window) must agree within 1e-4.
mod common;

use common::golden::{decoder_from_dir, golden_dir, CpuGolden, TEXT_GOLDENS};
use common::logits::{assert_near, forward_all, greedy_decode, model_pass, pass, worst};
use common::wide::{quantize_model, some_ids, write_wide_model, WIDE_SHAPES};
use wick_engine::backend::candle::CandleBackend;
use wick_engine::models::decoder::LogitsRequest;

#[test]
fn every_position_matches_transformers() {
    for variant in TEXT_GOLDENS {
        let g = CpuGolden::load(variant);
        for case in ["len1", "len7", "len40", "pair_a", "pair_b"] {
            let ids = g.case_ids(case);
            assert_near(variant, case, &g.all(&ids), &g.expected(case));
        }
    }
}

#[test]
fn incremental_decoding_matches_one_shot() {
    // Prefill in uneven chunks, then one token at a time: exercises the cache append path
    // and, for Gemma, eviction of keys that fell out of the sliding window.
    for variant in TEXT_GOLDENS {
        let g = CpuGolden::load(variant);
        let ids = g.case_ids("len40");
        let want = g.expected("len40");
        let vocab = g.model.config().vocab_size;
        let got = forward_all(&g.model, &ids, &[5, 3, 9, 1, 1, 1, 20]);
        assert_eq!(got.len(), ids.len() * vocab);
        assert_near(variant, "len40 incremental", &got, &want);
    }
}

#[test]
fn batched_sequences_match_single_runs() {
    for variant in TEXT_GOLDENS {
        CpuGolden::load(variant).batched_pair_matches_single_runs(variant, LogitsRequest::Last);
    }
}

#[test]
fn greedy_continuation_matches_generate() {
    for variant in TEXT_GOLDENS {
        let g = CpuGolden::load(variant);
        let (prompt, want) = g.greedy();
        let got = greedy_decode(&g.model, &prompt, want.len());
        assert_eq!(got, want, "{variant} greedy continuation");
    }
}

#[test]
fn cache_trim_and_snapshot_round_trip() {
    for variant in TEXT_GOLDENS {
        trim_and_snapshot(variant);
    }
}

fn trim_and_snapshot(variant: &str) {
    let g = CpuGolden::load(variant);
    let ids = g.case_ids("len40");
    let mut cache = g.model.new_cache();
    pass(&g.model, &ids[..12], &mut cache, LogitsRequest::None);
    // Within the window's slack nothing was dropped yet: trimming works.
    assert!(cache.can_trim_to(10));
    cache.trim(10).unwrap();
    let restored = g.model.cache_from_snapshot(&cache.snapshot()).unwrap();
    let mut c2 = restored.clone();
    let a = pass(&g.model, &ids[10..], &mut cache, LogitsRequest::All);
    let b = pass(&g.model, &ids[10..], &mut c2, LogitsRequest::All);
    assert_eq!(a, b);
    let want = g.expected("len40");
    let vocab = g.model.config().vocab_size;
    assert_near(variant, "after trim", &a.unwrap().data, &want[10 * vocab..]);
}

#[test]
fn a_wrapped_sliding_window_cannot_be_trimmed() {
    let g = CpuGolden::load("gemma3");
    let ids = g.case_ids("len40");
    let mut cache = g.model.new_cache();
    pass(&g.model, &ids, &mut cache, LogitsRequest::None);
    // 40 tokens through a window of 8: the sliding layers dropped the oldest keys.
    assert!(!cache.can_trim_to(5));
    assert!(cache.trim(5).is_err());
    assert!(cache.can_trim_to(40));
    // Keys leave in whole 16-token blocks and one block of slack stays, so a short cut
    // back still works (keys 32.. recompute position 39) while a long one does not.
    assert!(cache.can_trim_to(39));
    assert!(
        !cache.can_trim_to(20),
        "the first block (keys 0..16) is gone, so position 20 could not be recomputed"
    );
    assert_eq!(cache.len(), 40);
}

#[test]
fn model_load_reads_every_family_from_its_directory() {
    // The path `wick serve DIR` takes: config.json, per-family tensor names, tokenizer,
    // chat template; the logits must be the golden's.
    for variant in TEXT_GOLDENS {
        let g = CpuGolden::load(variant);
        let model = wick_engine::Model::load(&golden_dir(variant), &Default::default()).unwrap();
        assert_eq!(model.config(), g.model.config(), "{variant}");
        let ids = g.case_ids("len40");
        let out = model_pass(&model, &ids, &mut model.new_cache(), LogitsRequest::All);
        assert_near(
            variant,
            "Model::load len40",
            &out.unwrap().data,
            &g.expected("len40"),
        );
    }
}

/// The attention shapes of real models (head size 64–256, up to 32 query heads per KV
/// head), which the goldens (head size 16–32) do not have, on random-weight models: fed in
/// chunks, a sequence gets the logits of one pass (the GPU test compares its kernels to
/// these).
#[test]
fn wide_heads_in_chunks_equal_one_pass() {
    for (heads, kv_heads, hd) in WIDE_SHAPES {
        let dir = tempfile::tempdir().unwrap();
        write_wide_model(dir.path(), heads, kv_heads, hd);
        let m = decoder_from_dir(CandleBackend::cpu(), dir.path());
        let ids = some_ids(40, hd as u32);
        let want = forward_all(&m, &ids, &[ids.len()]);
        assert!(want.iter().all(|v| v.is_finite()));
        let spread = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert!(
            spread > 0.1,
            "{heads}/{kv_heads}/{hd}: logits all near zero"
        );
        assert_near(
            &format!("{heads}/{kv_heads} heads of {hd}"),
            "chunks",
            &forward_all(&m, &ids, &[5, 3, 9, 1, 1, 1, 20]),
            &want,
        );
    }
}

/// The MLX-quantized copies the CUDA reference test builds load as affine checkpoints and
/// stay near the f32 model they were made from (8 bits closer than 4).
#[test]
fn quantized_copies_of_a_model_stay_near_it() {
    let dense = tempfile::tempdir().unwrap();
    write_wide_model(dense.path(), 8, 2, 128);
    let f32_model = decoder_from_dir(CandleBackend::cpu(), dense.path());
    let ids = some_ids(12, 3);
    let want = forward_all(&f32_model, &ids, &[ids.len()]);
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let mut errors = Vec::new();
    for bits in [8, 4] {
        let dir = tempfile::tempdir().unwrap();
        write_wide_model(dir.path(), 8, 2, 128);
        quantize_model(dir.path(), bits, 64, wick_gguf::GgmlType::Bf16);
        let m = decoder_from_dir(CandleBackend::cpu(), dir.path());
        let (diff, _) = worst(&forward_all(&m, &ids, &[ids.len()]), &want);
        eprintln!("{bits} bits: max |diff| {diff:.3e} (scale {scale:.1})");
        assert!(diff > 0.0, "{bits} bits: nothing was quantized");
        errors.push(diff);
    }
    assert!(errors[0] < 0.05 * scale, "8 bits: {}", errors[0]);
    assert!(
        errors[0] < errors[1],
        "8 bits {} vs 4 bits {}",
        errors[0],
        errors[1]
    );
}

/// Long prompt chunks (past 1024 keys, where attention runs as matrix products) of a model
/// with f32 weights keep those products in f32: `Model::load` gives exactly the logits of
/// a decoder told to use f32 products, where bf16 operands (the products' precision on
/// AVX-512 BF16 and AMX CPUs) move them by about 1e-2. A quantized copy of the model
/// takes the bf16 products where the CPU has them.
#[test]
fn f32_weights_keep_long_prompt_attention_in_f32() {
    if std::env::var_os("WICK_PROMPT_ATTENTION").is_some() {
        eprintln!("skipped: WICK_PROMPT_ATTENTION overrides the precision chosen from the weights");
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let bf16_cpu = is_x86_feature_detected!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_cpu = false;
    if !bf16_cpu {
        eprintln!(
            "note: this CPU has no AVX-512 BF16, so every precision runs f32 products here \
             and the test cannot tell them apart"
        );
    }
    let ids = some_ids(1100, 44);
    for quantized in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        write_wide_model(dir.path(), 14, 2, 64);
        if quantized {
            quantize_model(dir.path(), 8, 64, wick_gguf::GgmlType::Bf16);
        }
        for file in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            std::fs::copy(golden_dir("qwen3").join(file), dir.path().join(file)).unwrap();
        }
        let model = wick_engine::Model::load(dir.path(), &Default::default()).unwrap();
        let mut cache = model.new_cache();
        let got = model
            .forward(&mut [wick_engine::Step {
                tokens: &ids,
                cache: &mut cache,
                logits: LogitsRequest::All,
            }])
            .unwrap()
            .remove(0)
            .unwrap()
            .data;
        let f32_products = CandleBackend::cpu().with_bf16_prompt_attention(false);
        let f32_logits = forward_all(
            &decoder_from_dir(f32_products, dir.path()),
            &ids,
            &[ids.len()],
        );
        let bf16_logits = forward_all(
            &decoder_from_dir(
                CandleBackend::cpu().with_bf16_prompt_attention(true),
                dir.path(),
            ),
            &ids,
            &[ids.len()],
        );
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let moved = got
            .iter()
            .zip(&bf16_logits)
            .zip(&f32_logits)
            .map(|((_, b), f)| (b - f).abs())
            .fold(0f32, f32::max);
        eprintln!("quantized {quantized}: bf16 products move logits by up to {moved:.2e}");
        if quantized {
            assert!(
                same(&got, &bf16_logits),
                "a quantized model took f32 products"
            );
        } else {
            assert!(same(&got, &f32_logits), "an f32 model took bf16 products");
        }
        if bf16_cpu {
            assert!(
                moved > 1e-4,
                "bf16 products changed nothing: the test cannot tell"
            );
        }
    }
}
