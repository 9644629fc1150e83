//! The CUDA backend against Hugging Face transformers' f32 logits (the goldens of
//! hf_reference.rs) and against the CPU backend: every position, chunked prefill, batched
//! sequences of different lengths, greedy decoding long enough that the decode step is
//! captured as a CUDA graph and replayed, prompts of thousands of tokens on the flash
//! kernels, Qwen 3.5's hybrids with their gated DeltaNet on the device, and PEFT adapters
//! on Qwen 3.5 and Gemma 4. Needs
//! `--features cuda`; without a GPU (or its driver) every test says it was skipped and
//! passes. Set `WICK_GOLDENS` to the goldens folder when the test binary runs away from its
//! checkout.
#![cfg(feature = "cuda")]
mod common;

use common::golden::{decoder_from_dir, golden_dir, read_json, TextGolden, TEXT_GOLDENS};
use common::hybrid_adapters::{all_with, mixed_batch, upload, HybridAdapters, MODELS};
use common::logits::{forward_all, forward_batch, greedy_lockstep, pass};
use common::wide::{quantize_model, some_ids, write_wide_model, WIDE_SHAPES};
use wick_engine::backend::candle::{CandleBackend, KvDtype};
use wick_engine::backend::cuda::{CudaBackend, FlashAttention};
use wick_engine::backend::{
    AttentionParams, AttentionSegment, Backend, DeltaInputs, DeltaParams, DeltaSegment, DeltaShape,
    DeltaState, DeltaStore, KvLayer,
};
use wick_engine::models::decoder::{
    BatchItem, Decoder, LogitsRequest, RowOutput, SequenceCache, Want,
};
use wick_gguf::GgmlType;

/// Every text golden but StarCoder 2's (it needs LayerNorm, which the CUDA backend lacks).
fn variants() -> impl Iterator<Item = &'static str> {
    TEXT_GOLDENS.into_iter().filter(|v| *v != "starcoder2")
}
/// Qwen 3.5's tiny hybrids (`scripts/goldens/hf_tiny_qwen35.py`): gated DeltaNet layers
/// (2 key heads of 16, 4 value heads of 24, a convolution of width 4) around a gated
/// full-attention layer.
const HYBRIDS: [&str; 2] = ["qwen35", "qwen35_tied"];
const TOLERANCE: f32 = 2e-4;

/// The GPU's backend, or `None` (the test then passes after saying so) where this machine
/// has no CUDA device or driver.
fn gpu() -> Option<CudaBackend> {
    // Exact flash attention: the comparisons are against f32 references.
    match CudaBackend::new(0) {
        Ok(b) => Some(b.with_flash(FlashAttention::Exact)),
        Err(e) if e.to_string().contains("CUDA is not available") => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

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
        let Some(be) = gpu() else { return };
        let m = g.decoder(be);
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
        let Some(be) = gpu() else { return };
        let m = g.decoder(be);
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

/// `steps` greedy tokens after each of `prompts` on the GPU (the argmax on the device), the
/// prompts decoded one at a time (`single`) or all in one batch.
fn greedy_on_gpu(
    cuda: &Decoder<CudaBackend>,
    prompts: &[Vec<u32>],
    steps: usize,
    single: bool,
) -> Vec<Vec<u32>> {
    let groups: Vec<Vec<usize>> = if single {
        (0..prompts.len()).map(|i| vec![i]).collect()
    } else {
        vec![(0..prompts.len()).collect()]
    };
    let mut all = vec![Vec::new(); prompts.len()];
    for group in groups {
        let mut caches: Vec<_> = group.iter().map(|_| cuda.new_cache()).collect();
        let mut next: Vec<Vec<u32>> = group.iter().map(|&i| prompts[i].clone()).collect();
        for _ in 0..steps {
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
    all
}

/// `steps` greedy tokens after `prompt` on the CPU backend (the argmax of its logits).
fn greedy_on_cpu(cpu: &Decoder<CandleBackend>, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut cache = cpu.new_cache();
    let mut next = prompt.to_vec();
    let mut want = Vec::new();
    for _ in 0..steps {
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
    want
}

/// Greedy decoding on the GPU (argmax on the device, steps replayed as graphs) gives the
/// CPU backend's tokens, one sequence and three at once.
#[test]
fn greedy_decoding_with_graphs_matches_the_cpu() {
    const STEPS: usize = 24;
    for variant in variants() {
        let g = TextGolden::open(variant);
        let Some(be) = gpu() else { return };
        let cuda = g.decoder(be);
        let cpu = g.decoder(CandleBackend::cpu());
        let prompts = [
            g.case_ids("len7"),
            g.case_ids("pair_a"),
            g.case_ids("pair_b"),
        ];
        let single = greedy_on_gpu(&cuda, &prompts, STEPS, true);
        let batched = greedy_on_gpu(&cuda, &prompts, STEPS, false);
        for (i, p) in prompts.iter().enumerate() {
            let want = greedy_on_cpu(&cpu, p, STEPS);
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
        let Some(be) = gpu() else { return };
        let cuda = g.decoder(be.with_kv_dtype(KvDtype::F16));
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
        if !wide_model_matches_the_cpu(heads, kv_heads, hd) {
            return;
        }
    }
}

/// A random-weight model of `heads`/`kv_heads` heads of `hd` on the GPU gives the CPU
/// backend's logits in one pass, in chunks and batched; `false` where there is no GPU.
fn wide_model_matches_the_cpu(heads: usize, kv_heads: usize, hd: usize) -> bool {
    let dir = tempfile::tempdir().unwrap();
    write_wide_model(dir.path(), heads, kv_heads, hd);
    let what = format!("{heads}/{kv_heads} heads of {hd}");
    let Some(be) = gpu() else { return false };
    let cuda = decoder_from_dir(be, dir.path());
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
    true
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
            let Some(be) = gpu() else { return };
            let cuda = decoder_from_dir(be, dir.path());
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

/// Qwen 3.5 on the GPU (the DeltaNet's convolution, delta rule and gated norm as kernels,
/// its states in device memory): transformers' logits and the CPU backend's at every
/// position, for prompts in one pass (token by token below 16 rows, 64-token chunks from
/// there; `len150` spans three chunks) and in pieces that switch between the two forms and
/// single decode rows.
#[test]
fn qwen35_logits_match_transformers_and_the_cpu() {
    for variant in HYBRIDS {
        let g = TextGolden::open(variant);
        let Some(be) = gpu() else { return };
        let cuda = g.decoder(be);
        let cpu = g.decoder(CandleBackend::cpu());
        for case in ["len1", "len7", "len40", "pair_a", "pair_b", "len150"] {
            let ids = g.case_ids(case);
            let got = forward_all(&cuda, &ids, &[ids.len()]);
            assert_close(variant, case, &got, &g.expected(case));
            let cpu_logits = forward_all(&cpu, &ids, &[ids.len()]);
            assert_close(
                variant,
                &format!("{case} against the cpu"),
                &got,
                &cpu_logits,
            );
        }
        for (case, chunks) in [
            ("len40", &[5, 3, 9, 1, 1, 1, 20][..]),
            ("len150", &[70, 1, 5, 64, 10][..]),
        ] {
            let ids = g.case_ids(case);
            assert_close(
                variant,
                &format!("{case} in chunks {chunks:?}"),
                &forward_all(&cuda, &ids, chunks),
                &g.expected(case),
            );
        }
    }
}

/// Sequences of both forms in one batch keep to their own states; a cache rebuilt from
/// host copies of its states (the prompt cache's tiers) and a clone of a live cache (the
/// prompt cache's entries: the states are shared until one side writes) continue as the
/// original does.
#[test]
fn qwen35_batches_restored_and_shared_states_match_single_runs() {
    for variant in HYBRIDS {
        let g = TextGolden::open(variant);
        let Some(be) = gpu() else { return };
        let cuda = g.decoder(be);
        let vocab = cuda.config().vocab_size;
        let (a, b, long) = (
            g.case_ids("pair_a"),
            g.case_ids("pair_b"),
            g.case_ids("len150"),
        );
        let (mut ca, mut cb, mut cl) = (cuda.new_cache(), cuda.new_cache(), cuda.new_cache());
        let out = forward_batch(
            &cuda,
            vec![
                (&a, &mut ca, LogitsRequest::All),
                (&b, &mut cb, LogitsRequest::All),
                (&long, &mut cl, LogitsRequest::Last),
            ],
        );
        assert_close(variant, "pair_a batched", &out[0], &g.expected("pair_a"));
        assert_close(variant, "pair_b batched", &out[1], &g.expected("pair_b"));
        let want = g.expected("len150");
        assert_close(
            variant,
            "len150 batched last row",
            &out[2],
            &want[want.len() - vocab..],
        );

        let (head, tail) = long.split_at(100);
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
        let mut cache = cuda.new_cache();
        step(&mut cache, head);
        let kv = cache.snapshot();
        let rec = cache.recurrent().unwrap().snapshot();
        let mut restored = cuda.cache_from_snapshots(&kv, Some(&rec)).unwrap();
        let mut shared = cache.clone();
        let want_tail = &want[100 * vocab..];
        assert_close(
            variant,
            "len150 after 100",
            &step(&mut cache, tail),
            want_tail,
        );
        assert_close(
            variant,
            "len150 on a clone taken after 100",
            &step(&mut shared, tail),
            want_tail,
        );
        assert_close(
            variant,
            "len150 rebuilt from the host after 100",
            &step(&mut restored, tail),
            want_tail,
        );
    }
}

/// Greedy decoding of Qwen 3.5 on the GPU (decode steps replayed as graphs, the DeltaNet
/// states updated in place) gives the CPU backend's tokens, one sequence and three at
/// once (one prompt longer than a chunk), and transformers' `generate` continuation.
#[test]
fn qwen35_greedy_decoding_with_graphs_matches_the_cpu_and_transformers() {
    const STEPS: usize = 16;
    for variant in HYBRIDS {
        let g = TextGolden::open(variant);
        let Some(be) = gpu() else { return };
        let cuda = g.decoder(be);
        let cpu = g.decoder(CandleBackend::cpu());
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let greedy = &g.reference["greedy"];
        let prompts = [
            g.case_ids("len7"),
            g.case_ids("len150"),
            ids(&greedy["prompt_ids"]),
        ];
        let single = greedy_on_gpu(&cuda, &prompts, STEPS, true);
        let batched = greedy_on_gpu(&cuda, &prompts, STEPS, false);
        for (i, p) in prompts.iter().enumerate() {
            let want = greedy_on_cpu(&cpu, p, STEPS);
            assert_eq!(single[i], want, "{variant} prompt {i} alone");
            assert_eq!(batched[i], want, "{variant} prompt {i} batched");
        }
        let generate = ids(&greedy["continuation_ids"]);
        assert_eq!(
            single[2][..generate.len().min(STEPS)],
            generate[..generate.len().min(STEPS)],
            "{variant}: transformers' greedy continuation"
        );
        let stats = cuda.backend().device().stats();
        eprintln!("{variant}: {stats:?}");
        assert!(
            stats.replayed > 0,
            "{variant}: no decode step was replayed from a graph"
        );
    }
}

/// Seeded values in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Runs the DeltaNet mixer of `p` on `be` over `passes` (each a list of rows per sequence,
/// the sequences' states carried from pass to pass): every pass's output, and the final
/// states in host memory.
fn mix_passes<B: Backend>(
    be: &B,
    p: &DeltaParams<'_>,
    passes: &[&[usize]],
) -> (Vec<Vec<f32>>, Vec<DeltaState>) {
    let sh = p.shape;
    let uploaded = be.delta_weights(p).unwrap();
    let mut states: Vec<B::DeltaState> = (0..passes[0].len())
        .map(|_| be.new_delta_state(&sh))
        .collect();
    let mut outs = Vec::new();
    for (pass, rows) in passes.iter().enumerate() {
        let n: usize = rows.iter().sum();
        let seed = 100 * pass as u64;
        let tensor =
            |cols: usize, seed: u64| be.tensor_from_host(noise(n * cols, seed), n, cols).unwrap();
        let qkv = tensor(sh.conv_dim(), seed);
        let z = tensor(sh.v_heads * sh.v_dim, seed + 1);
        let b = tensor(sh.v_heads, seed + 2);
        let a = tensor(sh.v_heads, seed + 3);
        let mut at = 0;
        let mut segments: Vec<DeltaSegment<'_, B::DeltaState>> = states
            .iter_mut()
            .zip(rows.iter())
            .map(|(state, &r)| {
                at += r;
                DeltaSegment {
                    rows: at - r..at,
                    state,
                }
            })
            .collect();
        let inputs = DeltaInputs {
            qkv: &qkv,
            z: &z,
            b: &b,
            a: &a,
        };
        let out = be
            .delta_net(p, uploaded.as_ref(), inputs, &mut segments)
            .unwrap();
        outs.push(be.rows_to_host(&out, &[n]).unwrap().concat());
    }
    (outs, states.iter().map(DeltaStore::to_host).collect())
}

/// The DeltaNet kernels at the real models' head sizes (128 key and value dimensions, two
/// value heads per key head: the state's every register row and column block, which the
/// tiny goldens' 16 × 24 heads do not reach) give the host's mixer: decode rows, short
/// rows token by token, one chunk exactly, and prompts of several chunks with a partial
/// last one, side by side in batches whose states carry from pass to pass.
#[test]
fn qwen35_deltanet_mixer_of_real_head_sizes_matches_the_host() {
    let Some(cuda) = gpu() else { return };
    let cpu = CandleBackend::cpu();
    let shape = DeltaShape {
        k_heads: 2,
        v_heads: 4,
        k_dim: 128,
        v_dim: 128,
        conv_kernel: 4,
    };
    let cd = shape.conv_dim();
    let conv = noise(cd * shape.conv_kernel, 1)
        .iter()
        .map(|w| w * 0.5)
        .collect::<Vec<_>>();
    // Decays per token between about 0.1 and 0.998 (by head and token): in the slow heads
    // what earlier chunks left in the state still counts 64 tokens on.
    let neg_a: Vec<f32> = noise(shape.v_heads, 2)
        .iter()
        .map(|x| -(2.0 * x - 2.0).exp())
        .collect();
    let dt_bias = noise(shape.v_heads, 3);
    let norm: Vec<f32> = noise(shape.v_dim, 4)
        .iter()
        .map(|x| 1.0 + 0.1 * x)
        .collect();
    let p = DeltaParams {
        shape,
        conv: &conv,
        neg_a: &neg_a,
        dt_bias: &dt_bias,
        norm: &norm,
        eps: 1e-6,
    };
    let passes: [&[usize]; 4] = [
        &[1, 5, 16, 150],
        &[1, 1, 1, 1],
        &[70, 3, 64, 1],
        &[1, 1, 1, 1],
    ];
    let (got, got_states) = mix_passes(&cuda, &p, &passes);
    let (want, want_states) = mix_passes(&cpu, &p, &passes);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close("DeltaNet 128", &format!("pass {i} {:?}", passes[i]), g, w);
    }
    for (i, (g, w)) in got_states.iter().zip(&want_states).enumerate() {
        assert_close(
            "DeltaNet 128",
            &format!("sequence {i}'s convolution state"),
            &g.conv,
            &w.conv,
        );
        assert_close(
            "DeltaNet 128",
            &format!("sequence {i}'s delta-rule state"),
            &g.ssm,
            &w.ssm,
        );
    }
}

fn flash_noise(n: usize, seed: u64) -> Vec<f32> {
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
        let x = flash_noise(n * w, seed)
            .into_iter()
            .map(|v| v * gain)
            .collect();
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
    for case in cases {
        if !attention_matches_the_cpu(case, &[FlashAttention::Exact, FlashAttention::Fast]) {
            return;
        }
    }
}

/// heads, KV heads, head size, window, soft cap, context, rows, spans (see [`two_passes`]).
type AttentionCase = (
    usize,
    usize,
    usize,
    Option<usize>,
    Option<f32>,
    usize,
    usize,
    bool,
);

/// [`two_passes`] of `case` on the GPU in each of `modes`, f32 and f16 caches, against the
/// CPU backend: exact (and off: the CUDA-core kernel) within 2e-5 of the outputs' scale
/// (1e-3 with f16 caches), fast within 5e-3. `false` where there is no GPU.
fn attention_matches_the_cpu(case: AttentionCase, modes: &[FlashAttention]) -> bool {
    let (heads, kv_heads, hd, window, softcap, context, rows, spans) = case;
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
            &CandleBackend::cpu()
                .with_bf16_prompt_attention(false)
                .with_kv_dtype(kv),
            &p,
            context,
            rows,
            spans,
        );
        for &mode in modes {
            let Some(be) = gpu() else { return false };
            let be = be.with_flash(mode).with_kv_dtype(kv);
            let got = two_passes(&be, &p, context, rows, spans);
            let bound = attention_bound(mode, kv);
            let (w, scale) = worst(&got, &want);
            let what = format!(
                "{heads}/{kv_heads} heads of {hd}, window {window:?}, cap {softcap:?}, \
                 {rows} rows after {context}, {kv:?} cache, {mode:?}"
            );
            eprintln!("{what}: max |diff| {w:.2e} (scale {scale:.2})");
            assert!(w <= bound * scale, "{what}: {w} > {bound} × {scale}");
        }
    }
    true
}

/// How far (relative to the outputs' scale) the GPU's attention in `mode` may be from the
/// CPU's with caches of `kv`: an f16 cache rounds keys and values to 11 bits on both
/// sides, but not always at the same point; fast flash rounds its products to f16.
fn attention_bound(mode: FlashAttention, kv: KvDtype) -> f32 {
    match (mode, kv) {
        (FlashAttention::Fast, _) => 5e-3,
        (_, KvDtype::F32) => 2e-5,
        _ => 1e-3,
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
    // f32 prompt attention on the CPU (on an AVX-512 BF16 or AMX host it would take bf16
    // products and be the less exact side).
    let cpu = |kv| {
        decoder_from_dir(
            CandleBackend::cpu()
                .with_bf16_prompt_attention(false)
                .with_kv_dtype(kv),
            dir,
        )
    };
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
            // Fast mode rounds to bf16, and with an f16 cache the two backends round keys
            // and values at different points (the CPU attends a chunk's own rows before
            // storing them): as far as an f16 cache moves the logits at most.
            let bound = match (mode, kv) {
                (FlashAttention::Exact, KvDtype::F32) => TOLERANCE * scale,
                _ => (3.0 * d16).max(TOLERANCE * scale),
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

/// Gemma 4's tiny goldens (`scripts/goldens/hf_tiny_gemma4.py`): `gemma4` is the E2B shape
/// (per-layer inputs, the last two of six layers reading earlier layers' caches, sliding
/// windows of 8, full-attention heads of 32 with proportional rotary), `gemma4_moe` the
/// 26B-A4B shape (experts routed on the host, `attention_k_eq_v`, one KV head on the full
/// layers).
const GEMMA4: [&str; 2] = ["gemma4", "gemma4_moe"];

/// Gemma 4 on the GPU against transformers' logits and the CPU backend's at every
/// position: prompts in one pass (40 rows attend on the flash kernels, fewer on the
/// CUDA-core kernel) and in chunks that cross the sliding window while the KV-shared
/// layers read their producers' caches.
#[test]
fn gemma4_logits_match_transformers_and_the_cpu_in_one_pass_and_in_chunks() {
    for variant in GEMMA4 {
        let g = TextGolden::open(variant);
        let Some(be) = gpu() else { return };
        let cuda = g.decoder(be);
        let cpu = g.decoder(CandleBackend::cpu());
        for case in ["len1", "len7", "len40", "pair_a", "pair_b"] {
            let ids = g.case_ids(case);
            let got = forward_all(&cuda, &ids, &[ids.len()]);
            assert_close(variant, case, &got, &g.expected(case));
            assert_close(
                variant,
                &format!("{case} against the cpu"),
                &got,
                &forward_all(&cpu, &ids, &[ids.len()]),
            );
        }
        let ids = g.case_ids("len40");
        for chunks in [&[5, 3, 9, 1, 1, 1, 20][..], &[17, 1, 22], &[1; 40]] {
            assert_close(
                variant,
                &format!("len40 in chunks {chunks:?}"),
                &forward_all(&cuda, &ids, chunks),
                &g.expected("len40"),
            );
        }
    }
}

/// Gemma 4 sequences of different lengths in one batch (each reading its own shared
/// caches) give their single runs' logits (transformers'), and a cache rebuilt from host
/// copies continues as the original does.
#[test]
fn gemma4_batched_sequences_and_restored_caches_match_single_runs() {
    for variant in GEMMA4 {
        let g = TextGolden::open(variant);
        let Some(be) = gpu() else { return };
        let cuda = g.decoder(be);
        let vocab = cuda.config().vocab_size;
        let (a, b, long) = (
            g.case_ids("pair_a"),
            g.case_ids("pair_b"),
            g.case_ids("len40"),
        );
        let (mut ca, mut cb, mut cl) = (cuda.new_cache(), cuda.new_cache(), cuda.new_cache());
        let out = forward_batch(
            &cuda,
            vec![
                (&a, &mut ca, LogitsRequest::All),
                (&b, &mut cb, LogitsRequest::All),
                (&long, &mut cl, LogitsRequest::Last),
            ],
        );
        assert_close(variant, "pair_a batched", &out[0], &g.expected("pair_a"));
        assert_close(variant, "pair_b batched", &out[1], &g.expected("pair_b"));
        let want = g.expected("len40");
        assert_close(
            variant,
            "len40 batched, last row",
            &out[2],
            &want[want.len() - vocab..],
        );
        // A batch of decode rows after the prompts: one token each.
        let (ta, tb, tl) = ([a[0]], [b[0]], [long[0]]);
        let single: Vec<Vec<f32>> = [(&a, &ta), (&b, &tb), (&long, &tl)]
            .iter()
            .map(|(prompt, t)| {
                let mut c = cuda.new_cache();
                pass(&cuda, prompt, &mut c, LogitsRequest::None);
                pass(&cuda, &t[..], &mut c, LogitsRequest::All)
                    .unwrap()
                    .data
            })
            .collect();
        let step = forward_batch(
            &cuda,
            vec![
                (&ta[..], &mut ca, LogitsRequest::All),
                (&tb[..], &mut cb, LogitsRequest::All),
                (&tl[..], &mut cl, LogitsRequest::All),
            ],
        );
        for (i, (got, want)) in step.iter().zip(&single).enumerate() {
            assert_close(variant, &format!("decode row {i} batched"), got, want);
        }

        let (head, tail) = long.split_at(25);
        let run = |cache: &mut SequenceCache<CudaBackend>, tokens: &[u32]| {
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
        let mut cache = cuda.new_cache();
        run(&mut cache, head);
        let mut restored = cuda.cache_from_snapshot(&cache.snapshot()).unwrap();
        let mut shared = cache.clone();
        let want_tail = &want[25 * vocab..];
        assert_close(variant, "len40 after 25", &run(&mut cache, tail), want_tail);
        assert_close(
            variant,
            "len40 on a clone taken after 25",
            &run(&mut shared, tail),
            want_tail,
        );
        assert_close(
            variant,
            "len40 rebuilt from the host after 25",
            &run(&mut restored, tail),
            want_tail,
        );
    }
}

/// Greedy decoding of Gemma 4 on the GPU gives the CPU backend's tokens: steps fed from
/// the host one sequence at a time and three at once (replayed as CUDA graphs where no
/// expert routing reads the host mid-step), and in lockstep with the ids kept on the device
/// (the per-layer inputs embed them there); and transformers' `generate` continuation.
/// `gemma4_chat` is the E2B shape with the chat template's tokenizer.
#[test]
fn gemma4_greedy_decoding_with_graphs_matches_the_cpu_and_transformers() {
    const STEPS: usize = 24;
    for variant in ["gemma4", "gemma4_moe", "gemma4_chat"] {
        let dir = golden_dir(variant);
        let reference = read_json(&dir.join("reference.json"));
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let (prompts, generate) = if variant == "gemma4_chat" {
            let prompt = ids(&reference["prompt_ids"]);
            let mut scripted = prompt.clone();
            scripted.extend(ids(&reference["scripted_ids"]));
            (vec![prompt, scripted], None)
        } else {
            let g = TextGolden::open(variant);
            let greedy = &reference["greedy"];
            (
                vec![
                    ids(&greedy["prompt_ids"]),
                    g.case_ids("len7"),
                    g.case_ids("len40"),
                ],
                Some(ids(&greedy["continuation_ids"])),
            )
        };
        let Some(be) = gpu() else { return };
        let cuda = decoder_from_dir(be, &dir);
        let cpu = decoder_from_dir(CandleBackend::cpu(), &dir);
        let single = greedy_on_gpu(&cuda, &prompts, STEPS, true);
        let stats = cuda.backend().device().stats();
        let batched = greedy_on_gpu(&cuda, &prompts, STEPS, false);
        let lockstep = greedy_lockstep(&cuda, &prompts, STEPS);
        for (i, p) in prompts.iter().enumerate() {
            let want = greedy_on_cpu(&cpu, p, STEPS);
            assert_eq!(single[i], want, "{variant} prompt {i} alone");
            assert_eq!(batched[i], want, "{variant} prompt {i} batched");
            assert_eq!(
                lockstep[i], want,
                "{variant} prompt {i} in lockstep on the device"
            );
        }
        if let Some(generate) = generate {
            let n = generate.len().min(STEPS);
            assert_eq!(
                single[0][..n],
                generate[..n],
                "{variant}: transformers' greedy continuation"
            );
        }
        eprintln!("{variant}: {stats:?} after the single runs");
        if variant != "gemma4_moe" {
            assert!(
                stats.replayed > 0,
                "{variant}: no decode step was replayed from a graph"
            );
        }
    }
}

/// Heads of 512 (Gemma 4's full-attention layers): the flash kernels (two blocks a tile,
/// each making half the outputs) and the CUDA-core kernel (16 dimensions a lane, taken by
/// decode rows, chunks under 16 rows and every row with flash off) against the CPU
/// backend's attention, op by op and through a random-weight model.
#[test]
fn head_size_512_matches_the_cpu() {
    let cases = [
        // heads, KV heads, head size, window, soft cap, context, rows, spans
        (8, 2, 512, None, None, 1200, 100, false),
        (16, 2, 512, Some(300), Some(30.0), 800, 40, true),
        (4, 1, 512, None, None, 600, 7, false),
        (8, 8, 512, Some(64), None, 300, 33, true),
    ];
    let modes = [
        FlashAttention::Exact,
        FlashAttention::Fast,
        FlashAttention::Off,
    ];
    for case in cases {
        if !attention_matches_the_cpu(case, &modes) {
            return;
        }
    }
    wide_model_matches_the_cpu(8, 2, 512);
}

/// Two layers sharing one cache per sequence on `be` (Gemma 4's KV sharing): in each pass
/// the first appends its keys and values and attends, then the second attends to the same
/// cache with its own queries and no rows of its own, and is the pass's last reader
/// (`evict`). `passes[i]` gives the rows of sequences A and B in pass `i`; with `spans`,
/// rows see a few keys past their position, within their pass. Returns both layers'
/// outputs of every pass, in order.
fn shared_passes<B: Backend>(
    be: &B,
    p: &AttentionParams,
    passes: &[[usize; 2]],
    spans: bool,
) -> Vec<f32> {
    let (qw, kw) = (p.heads * p.head_dim, p.kv_heads * p.head_dim);
    let mut a = be.new_kv_layer(p.kv_heads, p.head_dim, p.window);
    let mut b = be.new_kv_layer(p.kv_heads, p.head_dim, p.window);
    let mut out = Vec::new();
    for (pi, &[na, nb]) in passes.iter().enumerate() {
        let n = na + nb;
        let seed = 10 * pi as u64;
        let upload = |w: usize, seed: u64, gain: f32| {
            let x = flash_noise(n * w, seed)
                .into_iter()
                .map(|v| v * gain)
                .collect();
            be.tensor_from_host(x, n, w).unwrap()
        };
        let (q0, q1) = (upload(qw, seed + 1, 4.0), upload(qw, seed + 2, 4.0));
        let (k, v) = (upload(kw, seed + 3, 1.0), upload(kw, seed + 4, 1.0));
        let ends: Option<Vec<usize>> = spans.then(|| {
            let mut e = Vec::with_capacity(n);
            for (len, rows) in [(a.len(), na), (b.len(), nb)] {
                for i in 0..rows {
                    e.push((len + i + 1 + i % 3).min(len + rows));
                }
            }
            e
        });
        let mut segs = [
            AttentionSegment {
                rows: 0..na,
                cache: &mut a,
            },
            AttentionSegment {
                rows: na..n,
                cache: &mut b,
            },
        ];
        let first = be
            .attention_shared(&q0, Some((&k, &v)), &mut segs, p, false, ends.as_deref())
            .unwrap();
        let second = be
            .attention_shared(&q1, None, &mut segs, p, true, ends.as_deref())
            .unwrap();
        for t in [first, second] {
            out.extend(be.rows_to_host(&t, &[n]).unwrap().remove(0));
        }
    }
    out
}

/// A layer reading another layer's cache (`attention_shared` without new rows) on the GPU
/// against the CPU backend: prompt chunks on the flash kernels and decode rows on the
/// CUDA-core kernel, batched, sliding windows (which the CPU evicts only after the last
/// reader), soft caps, rows that see past their position, heads of 64 to 512; f32 and f16
/// caches. A shared read of a cache that lacks the pass's rows is an error.
#[test]
fn shared_kv_layers_match_the_cpu() {
    let passes = [[300, 50], [20, 1], [1, 1], [1, 17], [64, 1], [1, 1]];
    let cases = [
        // heads, KV heads, head size, window, soft cap, spans
        (8, 2, 256, Some(48), None, false),
        (8, 2, 512, None, Some(30.0), false),
        (4, 4, 64, Some(100), None, true),
        (16, 2, 512, Some(40), None, true),
    ];
    for (heads, kv_heads, hd, window, softcap, spans) in cases {
        let p = AttentionParams {
            heads,
            kv_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window,
            softcap,
        };
        for kv in [KvDtype::F32, KvDtype::F16] {
            let cpu = CandleBackend::cpu()
                .with_bf16_prompt_attention(false)
                .with_kv_dtype(kv);
            let want = shared_passes(&cpu, &p, &passes, spans);
            for mode in [FlashAttention::Exact, FlashAttention::Fast] {
                let Some(be) = gpu() else { return };
                let be = be.with_flash(mode).with_kv_dtype(kv);
                let got = shared_passes(&be, &p, &passes, spans);
                let what = format!(
                    "shared KV: {heads}/{kv_heads} heads of {hd}, window {window:?}, \
                     cap {softcap:?}, spans {spans}, {kv:?} cache, {mode:?}"
                );
                // Pass by pass, layer by layer, so a failure names where.
                let mut at = 0;
                for (pi, &[na, nb]) in passes.iter().enumerate() {
                    for layer in ["producing", "reading"] {
                        let len = (na + nb) * heads * hd;
                        let (g, w) = (&got[at..at + len], &want[at..at + len]);
                        let (diff, scale) = worst(g, w);
                        let bound = attention_bound(mode, kv);
                        assert!(
                            diff <= bound * scale,
                            "{what}: pass {pi} ({na}+{nb} rows), {layer} layer: max |diff| \
                             {diff} > {bound} × {scale}"
                        );
                        at += len;
                    }
                }
                let (w, scale) = worst(&got, &want);
                eprintln!("{what}: max |diff| {w:.2e} (scale {scale:.2})");
            }
        }
        let Some(be) = gpu() else { return };
        let mut empty = be.new_kv_layer(kv_heads, hd, window);
        let q = be
            .tensor_from_host(vec![0.0; 3 * heads * hd], 3, heads * hd)
            .unwrap();
        let err = be
            .attention_shared(
                &q,
                None,
                &mut [AttentionSegment {
                    rows: 0..3,
                    cache: &mut empty,
                }],
                &p,
                true,
                None,
            )
            .err()
            .expect("a shared read of an empty cache must fail");
        assert!(err.to_string().contains("does not hold"), "{err}");
    }
}

/// PEFT's all-linear adapters on Qwen 3.5 and Gemma 4 (DeltaNet projections, the gated
/// q_proj, per-layer-input projections, the router; `goldens/adapters/hybrid`): the GPU's
/// logits with each adapter equal the CPU backend's and PEFT's at every position, in one
/// pass and in pieces down to single decode rows, and rows on different adapters and on
/// the base model in one batch each get their own.
#[test]
fn hybrid_adapters_match_the_cpu_and_peft() {
    let g = HybridAdapters::open();
    let ids = g.ids();
    for model in MODELS {
        let Some(be) = gpu() else { return };
        let golden = TextGolden::open(model);
        let cuda = golden.decoder(be);
        let cpu = golden.decoder(CandleBackend::cpu());
        let (a, b) = (upload(&cuda, model, "a"), upload(&cuda, model, "b"));
        let (cpu_a, cpu_b) = (upload(&cpu, model, "a"), upload(&cpu, model, "b"));
        for (sel, w, cw) in [("a", &a, &cpu_a), ("b", &b, &cpu_b)] {
            let on_cpu = all_with(&cpu, &ids, &[ids.len()], &[cw]);
            let want = g.expected(model, sel);
            for chunks in [&[ids.len()][..], &[4, 1, 1, 6][..]] {
                let got = all_with(&cuda, &ids, chunks, &[w]);
                let what = format!("adapter {sel} in chunks {chunks:?}");
                assert_close(model, &format!("{what} against the cpu"), &got, &on_cpu);
                assert_close(model, &what, &got, &want);
            }
        }
        let got = mixed_batch(&cuda, &ids, 9, &[vec![&a], Vec::new(), vec![&b]]);
        for (sel, got) in ["a", "none", "b"].iter().zip(&got) {
            let what = format!("adapter {sel} in a mixed batch");
            assert_close(model, &what, got, &g.expected(model, sel));
        }
    }
}
