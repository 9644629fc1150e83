//! The CUDA backend against Hugging Face transformers' f32 logits (the goldens of
//! hf_reference.rs) and against the CPU backend: every position, chunked prefill, batched
//! sequences of different lengths, and greedy decoding long enough that the decode step is
//! captured as a CUDA graph and replayed. Needs `--features cuda` and an NVIDIA GPU; set
//! `WICK_GOLDENS` to the goldens folder when the test binary runs away from its checkout.
#![cfg(feature = "cuda")]
mod common;

use common::golden::{decoder_from_dir, TextGolden, TEXT_GOLDENS};
use common::logits::{forward_all, forward_batch, greedy_decode, pass, worst};
use common::wide::{quantize_model, some_ids, write_wide_model, WIDE_SHAPES};
use wick_engine::backend::candle::{CandleBackend, KvDtype};
use wick_engine::backend::cuda::CudaBackend;
use wick_engine::models::decoder::{BatchItem, LogitsRequest, RowOutput, SequenceCache, Want};
use wick_gguf::GgmlType;

/// Every text golden but StarCoder 2's (it needs LayerNorm, which the CUDA backend lacks).
fn variants() -> impl Iterator<Item = &'static str> {
    TEXT_GOLDENS.into_iter().filter(|v| *v != "starcoder2")
}
const TOLERANCE: f32 = 2e-4;

fn assert_close(variant: &str, what: &str, got: &[f32], want: &[f32]) {
    let (w, scale) = worst(got, want);
    eprintln!("{variant} {what}: max |diff| {w:.2e} (scale {scale:.1})");
    assert!(
        w <= TOLERANCE * scale,
        "{variant} {what}: max |diff| {w} > {TOLERANCE} × {scale}"
    );
}

#[test]
fn logits_match_transformers_in_one_pass_and_in_chunks() {
    for variant in variants() {
        let g = TextGolden::open(variant);
        let m = g.decoder(CudaBackend::new(0).unwrap());
        for case in ["len1", "len7", "len40", "pair_a", "pair_b"] {
            let ids = g.case_ids(case);
            assert_close(
                variant,
                case,
                &forward_all(&m, &ids, &[ids.len()]),
                &g.expected(case),
            );
        }
        let ids = g.case_ids("len40");
        let got = forward_all(&m, &ids, &[5, 3, 9, 1, 1, 1, 20]);
        assert_close(variant, "len40 in chunks", &got, &g.expected("len40"));
    }
}

#[test]
fn batched_sequences_match_single_runs() {
    for variant in variants() {
        let g = TextGolden::open(variant);
        let m = g.decoder(CudaBackend::new(0).unwrap());
        let (a, b) = (g.case_ids("pair_a"), g.case_ids("pair_b"));
        let (mut ca, mut cb) = (m.new_cache(), m.new_cache());
        let out = forward_batch(
            &m,
            vec![
                (&a, &mut ca, LogitsRequest::All),
                (&b, &mut cb, LogitsRequest::Last),
            ],
        );
        assert_close(variant, "pair_a batched", &out[0], &g.expected("pair_a"));
        let want_b = g.expected("pair_b");
        let vocab = m.config().vocab_size;
        assert_close(
            variant,
            "pair_b batched last row",
            &out[1],
            &want_b[want_b.len() - vocab..],
        );
    }
}

/// Greedy decoding on the GPU (argmax on the device, steps replayed as graphs) gives the
/// CPU backend's tokens, one sequence and three at once; the logits of the last step agree.
#[test]
fn greedy_decoding_with_graphs_matches_the_cpu() {
    const STEPS: usize = 24;
    for variant in variants() {
        let g = TextGolden::open(variant);
        let cuda = g.decoder(CudaBackend::new(0).unwrap());
        let cpu = g.decoder(CandleBackend::cpu());
        let prompts = [
            g.case_ids("len7"),
            g.case_ids("pair_a"),
            g.case_ids("pair_b"),
        ];
        let run = |single: bool| -> Vec<Vec<u32>> {
            let mut out = Vec::new();
            let groups: Vec<Vec<usize>> = if single {
                (0..prompts.len()).map(|i| vec![i]).collect()
            } else {
                vec![(0..prompts.len()).collect()]
            };
            let mut all = vec![Vec::new(); prompts.len()];
            for group in groups {
                let mut caches: Vec<_> = group.iter().map(|_| cuda.new_cache()).collect();
                let mut next: Vec<Vec<u32>> = group.iter().map(|&i| prompts[i].clone()).collect();
                for _ in 0..STEPS {
                    let mut items: Vec<BatchItem<'_, CudaBackend>> = caches
                        .iter_mut()
                        .zip(&next)
                        .map(|(c, t)| BatchItem::new(t, c, Want::Token))
                        .collect();
                    let ids: Vec<u32> = cuda
                        .execute(&mut items, None)
                        .unwrap()
                        .into_iter()
                        .map(|o| match o {
                            RowOutput::Token(id) => id,
                            other => panic!("no token: {other:?}"),
                        })
                        .collect();
                    for ((&i, t), id) in group.iter().zip(next.iter_mut()).zip(ids) {
                        all[i].push(id);
                        *t = vec![id];
                    }
                }
            }
            out.extend(all);
            out
        };
        let single = run(true);
        let batched = run(false);
        for (i, p) in prompts.iter().enumerate() {
            let want = greedy_decode(&cpu, p, STEPS);
            assert_eq!(single[i], want, "{variant} prompt {i} alone");
            assert_eq!(batched[i], want, "{variant} prompt {i} batched");
        }
        let stats = cuda.backend().device().stats();
        eprintln!("{variant}: {stats:?}");
        assert!(
            stats.replayed > 0,
            "{variant}: no decode step was replayed from a graph"
        );
    }
}

/// With f16 KV caches (`--kv-type f16`) the GPU gives the CPU backend's f16-cache logits
/// (both round keys and values to f16 the same way), in chunks; a cache read back to the
/// host and rebuilt (what the prompt cache's tiers do) continues as the original does.
#[test]
fn f16_caches_match_the_cpu_and_survive_a_host_round_trip() {
    for variant in variants() {
        let g = TextGolden::open(variant);
        let cuda = g.decoder(CudaBackend::new(0).unwrap().with_kv_dtype(KvDtype::F16));
        let cpu = g.decoder(CandleBackend::cpu().with_kv_dtype(KvDtype::F16));
        let ids = g.case_ids("len40");
        let chunks = [5, 3, 9, 1, 1, 1, 20];
        assert_close(
            variant,
            "len40 f16 cache in chunks",
            &forward_all(&cuda, &ids, &chunks),
            &forward_all(&cpu, &ids, &chunks),
        );
        let (head, tail) = ids.split_at(30);
        let mut cache = cuda.new_cache();
        let step = |cache: &mut SequenceCache<CudaBackend>, tokens: &[u32]| {
            pass(&cuda, tokens, cache, LogitsRequest::All).unwrap().data
        };
        step(&mut cache, head);
        let mut restored = cuda.cache_from_snapshot(&cache.snapshot()).unwrap();
        assert_close(
            variant,
            "f16 cache rebuilt from the host",
            &step(&mut restored, tail),
            &step(&mut cache, tail),
        );
    }
}

/// Attention shapes of real models (head size 64–256, 1–32 query heads per KV head: every
/// kernel variant the tiny goldens, all of head size 16–32, do not reach) on random-weight
/// models: the GPU's logits equal the CPU backend's in one pass, in chunks and batched.
#[test]
fn wide_heads_match_the_cpu() {
    for (heads, kv_heads, hd) in WIDE_SHAPES {
        let dir = tempfile::tempdir().unwrap();
        write_wide_model(dir.path(), heads, kv_heads, hd);
        let what = format!("{heads}/{kv_heads} heads of {hd}");
        let cuda = decoder_from_dir(CudaBackend::new(0).unwrap(), dir.path());
        let cpu = decoder_from_dir(CandleBackend::cpu(), dir.path());
        let ids = some_ids(40, hd as u32);
        let want = forward_all(&cpu, &ids, &[ids.len()]);
        for chunks in [&[40][..], &[5, 3, 9, 1, 1, 1, 20]] {
            assert_close(
                &what,
                &format!("chunks {chunks:?}"),
                &forward_all(&cuda, &ids, chunks),
                &want,
            );
        }
        let other = some_ids(23, 7);
        let (mut ca, mut cb) = (cuda.new_cache(), cuda.new_cache());
        let out = forward_batch(
            &cuda,
            vec![
                (&ids, &mut ca, LogitsRequest::All),
                (&other, &mut cb, LogitsRequest::All),
            ],
        );
        assert_close(&what, "batched", &out[0], &want);
        assert_close(
            &what,
            "batched, second row",
            &out[1],
            &forward_all(&cpu, &other, &[other.len()]),
        );
    }
}

/// MLX-quantized matrices (4 and 8 bits, groups of 32 and 64; bf16, f16 or f32 scales, the
/// last as GGUF blocks re-laid out get them) stay packed on the GPU. Products of one and
/// two rows run on the quantized kernels, which quantize their inputs to signed bytes (one
/// scale per 32 inputs at 4 bits, 16 at 8 bits) for byte dot products; longer chunks'
/// products dequantize to bf16 for cuBLAS (weights and inputs rounded to bf16). Both stay
/// within 3% of the logits' scale of the CPU backend (which multiplies the same weights
/// dequantized to f32 with f32 inputs).
#[test]
fn affine_weights_match_the_cpu() {
    let cases = [
        (8, 64, GgmlType::Bf16),
        (4, 64, GgmlType::Bf16),
        (4, 32, GgmlType::F16),
        (8, 32, GgmlType::F16),
        (4, 32, GgmlType::F32),
        (8, 32, GgmlType::F32),
    ];
    for (bits, group, side) in cases {
        for (heads, kv_heads, hd) in [(8, 2, 128), (14, 2, 64)] {
            let dir = tempfile::tempdir().unwrap();
            write_wide_model(dir.path(), heads, kv_heads, hd);
            quantize_model(dir.path(), bits, group, side);
            let what =
                format!("{bits}-bit groups of {group} ({side}), {heads}/{kv_heads} heads of {hd}");
            let cuda = decoder_from_dir(CudaBackend::new(0).unwrap(), dir.path());
            let cpu = decoder_from_dir(CandleBackend::cpu(), dir.path());
            let ids = some_ids(30, bits + group as u32);
            let want = forward_all(&cpu, &ids, &[ids.len()]);
            for chunks in [&[1, 2, 2, 1][..], &[30], &[3, 8, 1, 5]] {
                let (w, scale) = worst(&forward_all(&cuda, &ids, chunks), &want);
                eprintln!("{what} chunks {chunks:?}: max |diff| {w:.2e} (scale {scale:.1})");
                assert!(w <= 3e-2 * scale, "{what} {chunks:?}: {w} > 3e-2 × {scale}");
            }
        }
    }
}
