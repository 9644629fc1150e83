//! The CUDA backend against Hugging Face transformers' f32 logits (the goldens of
//! hf_reference.rs) and against the CPU backend: every position, chunked prefill, batched
//! sequences of different lengths, greedy decoding long enough that the decode step is
//! captured as a CUDA graph and replayed, and prompts of thousands of tokens on the flash
//! kernels. Needs `--features cuda` and an NVIDIA GPU; set `WICK_GOLDENS` to the goldens
//! folder when the test binary runs away from its checkout.
#![cfg(feature = "cuda")]
mod common;

use common::{
    decoder_from_dir, forward_all, forward_batch, quantize_model, some_ids, write_wide_model,
    TextGolden, WIDE_SHAPES,
};
use wick_engine::backend::candle::{CandleBackend, KvDtype};
use wick_engine::backend::cuda::{CudaBackend, FlashAttention};
use wick_engine::backend::{AttentionParams, AttentionSegment, Backend};
use wick_engine::models::decoder::{BatchItem, LogitsRequest, RowOutput, SequenceCache, Want};
use wick_gguf::GgmlType;

/// The families whose ops the CUDA backend has (StarCoder 2 needs LayerNorm).
const VARIANTS: [&str; 13] = [
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
    "smollm3",
    "glm4",
    "minicpm",
];
const TOLERANCE: f32 = 2e-4;

fn worst(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    (worst, scale)
}

/// The GPU backend with exact flash attention (prompt chunks' products as exact as f32
/// ones), so that the f32 tolerance of these tests keeps its meaning; the default fast
/// kernels (f16 products) are checked against their own bound by the `flash_*` tests.
fn gpu() -> CudaBackend {
    CudaBackend::new(0)
        .unwrap()
        .with_flash(FlashAttention::Exact)
}

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
    for variant in VARIANTS {
        let g = TextGolden::open(variant);
        let m = g.decoder(gpu());
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
    for variant in VARIANTS {
        let g = TextGolden::open(variant);
        let m = g.decoder(gpu());
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
    for variant in VARIANTS {
        let g = TextGolden::open(variant);
        let cuda = g.decoder(gpu());
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
            let mut cache = cpu.new_cache();
            let mut next = p.clone();
            let mut want = Vec::new();
            for _ in 0..STEPS {
                let out = cpu
                    .forward_logits(&mut [BatchItem::new(
                        &next,
                        &mut cache,
                        Want::logits(LogitsRequest::Last),
                    )])
                    .unwrap();
                let l = &out[0].as_ref().unwrap().data;
                let id = l
                    .iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |b, (j, &v)| if v > b.1 { (j, v) } else { b },
                    )
                    .0 as u32;
                want.push(id);
                next = vec![id];
            }
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
    for variant in VARIANTS {
        let g = TextGolden::open(variant);
        let cuda = g.decoder(gpu().with_kv_dtype(KvDtype::F16));
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
            cuda.forward_logits(&mut [BatchItem::new(
                tokens,
                cache,
                Want::logits(LogitsRequest::All),
            )])
            .unwrap()[0]
                .as_ref()
                .unwrap()
                .data
                .clone()
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
        let cuda = decoder_from_dir(gpu(), dir.path());
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
            let cuda = decoder_from_dir(gpu(), dir.path());
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

/// `n` values uniform in [-1, 1), seeded.
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// One layer's attention on `be`, two passes: `context` tokens of sequence A batched with
/// 50 of sequence B, then `rows` new rows of A (seeing the keys before `ends` when `spans`:
/// runs of 7 rows see each other, every third row only its past) batched with one decode
/// row of B. Returns the second pass's output.
fn two_passes<B: Backend>(
    be: &B,
    p: &AttentionParams,
    context: usize,
    rows: usize,
    spans: bool,
) -> Vec<f32> {
    let (qw, kw) = (p.heads * p.head_dim, p.kv_heads * p.head_dim);
    let mut a = be.new_kv_layer(p.kv_heads, p.head_dim, p.window);
    let mut b = be.new_kv_layer(p.kv_heads, p.head_dim, p.window);
    let upload = |n: usize, w: usize, seed: u64, gain: f32| {
        let x = noise(n * w, seed).into_iter().map(|v| v * gain).collect();
        be.tensor_from_host(x, n, w).unwrap()
    };
    let n = context + 50;
    be.attention(
        &upload(n, qw, 1, 4.0),
        &upload(n, kw, 2, 1.0),
        &upload(n, kw, 3, 1.0),
        &mut [
            AttentionSegment {
                rows: 0..context,
                cache: &mut a,
            },
            AttentionSegment {
                rows: context..n,
                cache: &mut b,
            },
        ],
        p,
    )
    .unwrap();
    let n = rows + 1;
    let (q, k, v) = (
        upload(n, qw, 4, 4.0),
        upload(n, kw, 5, 1.0),
        upload(n, kw, 6, 1.0),
    );
    let mut segs = [
        AttentionSegment {
            rows: 0..rows,
            cache: &mut a,
        },
        AttentionSegment {
            rows: rows..n,
            cache: &mut b,
        },
    ];
    let out = if spans {
        let ends: Vec<usize> = (0..n)
            .map(|r| match r {
                _ if r == rows => 51,
                _ if r % 3 == 0 => context + r + 1,
                _ => context + ((r / 7 + 1) * 7).min(rows),
            })
            .collect();
        be.attention_to(&q, &k, &v, &mut segs, p, &ends)
    } else {
        be.attention(&q, &k, &v, &mut segs, p)
    }
    .unwrap();
    be.rows_to_host(&out, &[n]).unwrap().remove(0)
}

/// The flash kernels op by op against the CPU backend's attention: head sizes 64–256 (80
/// and 96 padded to 128), groups of 1 to 32 query heads, windows, soft caps, rows that see
/// past their position (`attention_to`), prompt chunks batched with a decode row (which
/// stays on the CUDA-core kernel), keys split into parts; f32 and f16 caches. Exact: as
/// f32 (within 2e-5 of the outputs' scale); fast (f16 products): within 5e-3.
#[test]
fn flash_attention_matches_the_cpu_op_by_op() {
    let cases = [
        // heads, KV heads, head size, window, soft cap, context, rows, spans
        (8, 2, 128, None, None, 1500, 200, false),
        (14, 2, 64, Some(333), None, 1000, 64, true),
        (4, 4, 80, None, Some(20.0), 700, 33, true),
        (12, 4, 96, None, None, 300, 16, false),
        (8, 1, 256, Some(500), Some(50.0), 2000, 100, false),
        (32, 1, 128, None, None, 3000, 17, false),
    ];
    for (heads, kv_heads, hd, window, softcap, context, rows, spans) in cases {
        let p = AttentionParams {
            heads,
            kv_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window,
            softcap,
        };
        for kv in [KvDtype::F32, KvDtype::F16] {
            let want = two_passes(
                &CandleBackend::cpu().with_kv_dtype(kv),
                &p,
                context,
                rows,
                spans,
            );
            for (mode, bound) in [(FlashAttention::Exact, 2e-5), (FlashAttention::Fast, 5e-3)] {
                let be = CudaBackend::new(0)
                    .unwrap()
                    .with_flash(mode)
                    .with_kv_dtype(kv);
                let got = two_passes(&be, &p, context, rows, spans);
                let (w, scale) = worst(&got, &want);
                let what = format!(
                    "{heads}/{kv_heads} heads of {hd}, window {window:?}, cap {softcap:?}, \
                     {rows} rows after {context}, {kv:?} cache, {mode:?}"
                );
                eprintln!("{what}: max |diff| {w:.2e} (scale {scale:.2})");
                assert!(w <= bound * scale, "{what}: {w} > {bound} × {scale}");
            }
        }
    }
}

/// A long prompt's logits on the GPU, whose prompt chunks attend on the flash kernels,
/// against the CPU backend: f32 and f16 caches, in one pass, in chunks (a 7-token chunk
/// between long ones takes the CUDA-core kernel over the long cache), and batched with a
/// second prompt of 700 tokens. Exact flash holds the f32 tolerance; fast flash (f16
/// products, as llama.cpp's and FlashAttention's) stays within three times what rounding
/// the cache to f16 moves the CPU's logits.
fn long_prompt_matches_the_cpu(what: &str, dir: &std::path::Path, n: usize, seed: u32) {
    let ids = some_ids(n, seed);
    let other = some_ids(700, seed + 1);
    let cpu = |kv| decoder_from_dir(CandleBackend::cpu().with_kv_dtype(kv), dir);
    let (cpu32, cpu16) = (cpu(KvDtype::F32), cpu(KvDtype::F16));
    let want32 = forward_all(&cpu32, &ids, &[n]);
    let want16 = forward_all(&cpu16, &ids, &[n]);
    let (d16, scale) = worst(&want16, &want32);
    eprintln!("{what}: f16 cache on the CPU moves the logits by {d16:.2e} (scale {scale:.1})");
    for (kv, want, cpu) in [
        (KvDtype::F32, &want32, &cpu32),
        (KvDtype::F16, &want16, &cpu16),
    ] {
        let want_other = forward_all(cpu, &other, &[other.len()]);
        for mode in [FlashAttention::Exact, FlashAttention::Fast] {
            let bound = match mode {
                FlashAttention::Fast => (3.0 * d16).max(TOLERANCE * scale),
                _ => TOLERANCE * scale,
            };
            let be = CudaBackend::new(0)
                .unwrap()
                .with_flash(mode)
                .with_kv_dtype(kv);
            let cuda = decoder_from_dir(be, dir);
            let check = |how: String, got: &[f32], want: &[f32]| {
                let (w, scale) = worst(got, want);
                eprintln!("{what} {kv:?} {mode:?} {how}: max |diff| {w:.2e} (scale {scale:.1})");
                assert!(w <= bound, "{what} {kv:?} {mode:?} {how}: {w} > {bound}");
            };
            for chunks in [&[n][..], &[512], &[1000, 7, 300]] {
                check(
                    format!("chunks {chunks:?}"),
                    &forward_all(&cuda, &ids, chunks),
                    want,
                );
            }
            let (mut ca, mut cb) = (cuda.new_cache(), cuda.new_cache());
            let out = forward_batch(
                &cuda,
                vec![
                    (&ids, &mut ca, LogitsRequest::All),
                    (&other, &mut cb, LogitsRequest::All),
                ],
            );
            check("batched".into(), &out[0], want);
            check("batched, second prompt".into(), &out[1], &want_other);
        }
    }
}

/// Long prompts with the attention shapes of real models (Llama-3-like groups of 4 at
/// head size 128, Gemma's 256, groups of 8).
#[test]
fn flash_long_prompts_match_the_cpu() {
    for (heads, kv_heads, hd, n) in [(8, 2, 128, 3072), (8, 2, 256, 2048), (16, 2, 128, 1024)] {
        let dir = tempfile::tempdir().unwrap();
        write_wide_model(dir.path(), heads, kv_heads, hd);
        let what = format!("{heads}/{kv_heads} heads of {hd}, {n} tokens");
        long_prompt_matches_the_cpu(&what, dir.path(), n, hd as u32);
    }
}

/// A long prompt through the Gemma 2 golden's sliding windows (8 tokens) and soft caps.
#[test]
fn flash_sliding_window_golden_matches_the_cpu() {
    let g = TextGolden::open("gemma2");
    long_prompt_matches_the_cpu("gemma2, 1500 tokens", &g.dir, 1500, 3);
}
