//! The CUDA backend against Hugging Face transformers' f32 logits (the goldens of
//! hf_reference.rs) and against the CPU backend: every position, chunked prefill, batched
//! sequences of different lengths, greedy decoding long enough that the decode step is
//! captured as a CUDA graph and replayed, prompts of thousands of tokens on the flash
//! kernels, Qwen 3.5's hybrids with their gated DeltaNet on the device, PEFT adapters on
//! Qwen 3.5 and Gemma 4, and the media towers (Gemma 3's and Gemma 4's vision, Gemma 4's
//! audio, Qwen-VL's vision with M-RoPE positions) on the goldens of `hf_*_vision.rs` and
//! `hf_gemma4_audio.rs`. Needs
//! `--features cuda`; without a GPU (or its driver) every test says it was skipped and
//! passes. Set `WICK_GOLDENS` to the goldens folder when the test binary runs away from its
//! checkout.
#![cfg(feature = "cuda")]
mod common;

use common::golden::{decoder_from_dir, floats, golden_dir, read_json, TextGolden, TEXT_GOLDENS};
use common::hybrid_adapters::{all_with, mixed_batch, upload, HybridAdapters, MODELS};
use common::logits::{forward_all, forward_batch, greedy_lockstep, pass};
use common::media::cases::{gemma3_media, gemma4_image_and_clip, gemma4_media, qwen_media};
use common::media::{audio_media, check_close, MediaGolden, MediaOf, Tolerance};
use common::wide::{bf16_model, quantize_model, some_ids, write_wide_model, WIDE_SHAPES};
use wick_engine::backend::candle::{CandleBackend, KvDtype};
use wick_engine::backend::cuda::{CudaBackend, FlashAttention};
use wick_engine::backend::{
    Activation, AttentionParams, AttentionSegment, Backend, BackendKind, DeltaInputs, DeltaParams,
    DeltaSegment, DeltaShape, DeltaState, DeltaStore, Experts, HostWeight, KvLayer, RopeSpec,
    RopeStyle,
};
use wick_engine::models::decoder::{
    BatchItem, Decoder, LogitsRequest, RowOutput, SequenceCache, Want,
};
use wick_engine::LoadOptions;
use wick_gguf::GgmlType;

/// Every text golden (StarCoder 2's with its LayerNorms and ungated GELU MLP too).
fn variants() -> impl Iterator<Item = &'static str> {
    TEXT_GOLDENS.into_iter()
}
/// Qwen 3.5's tiny hybrids (`scripts/goldens/hf_tiny_qwen35.py`): gated DeltaNet layers
/// (2 key heads of 16, 4 value heads of 24, a convolution of width 4) around a gated
/// full-attention layer.
const HYBRIDS: [&str; 2] = ["qwen35", "qwen35_tied"];
const TOLERANCE: f32 = 2e-4;

/// The GPU's backend, or `None` (the test then passes after saying so) where this machine
/// has no CUDA device or driver.
fn gpu() -> Option<CudaBackend> {
    exact_flash_for_loaded_models();
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

/// Models loaded as `wick serve` loads them (the media goldens, through `Model::load`)
/// take their flash mode from `WICK_CUDA_FLASH`: set to exact once, before this binary's
/// first CUDA backend starts (every path to one calls this first), so no reader of the
/// environment in the driver races the write.
fn exact_flash_for_loaded_models() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| std::env::set_var("WICK_CUDA_FLASH", "exact"));
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

/// A bf16 model's prompt passes, whose norms and GLUs write the half copies their cuBLAS
/// products read, give the very logits of passes where each product converts its input
/// itself: one pass, chunks of many rows and of few (wick's own kernels, no copies), and
/// two prompts batched. The gate-and-up product's sums stored in bf16 (the default) move
/// the logits about as far as the products' bf16 inputs already do (on an H100 0.111
/// against 0.112, logits of scale 29.5); more than twice that fails.
#[test]
fn half_copies_give_the_logits_of_the_conversion_pass() {
    let dir = tempfile::tempdir().unwrap();
    write_wide_model(dir.path(), 8, 2, 128);
    bf16_model(dir.path());
    let Some(be) = gpu() else { return };
    let with = decoder_from_dir(be.with_half_copies(true).with_half_glu(false), dir.path());
    let Some(be) = gpu() else { return };
    let without = decoder_from_dir(be.with_half_copies(false).with_half_glu(false), dir.path());
    let ids = some_ids(300, 11);
    {
        let Some(be) = gpu() else { return };
        let half_glu = decoder_from_dir(be.with_half_glu(true), dir.path());
        let cpu = decoder_from_dir(CandleBackend::cpu(), dir.path());
        let want = forward_all(&cpu, &ids, &[300]);
        let f32_sums = forward_all(&with, &ids, &[300]);
        let (inputs, scale) = worst(&f32_sums, &want);
        let (sums, _) = worst(&forward_all(&half_glu, &ids, &[300]), &f32_sums);
        eprintln!(
            "bf16 inputs move the logits by {inputs:.2e}, bf16 GLU sums by {sums:.2e} more \
             (scale {scale:.1})"
        );
        assert!(
            sums > 0.0 && sums <= 2.0 * inputs.max(1e-3 * scale),
            "{sums} > {inputs}"
        );
    }
    let other = some_ids(120, 12);
    for chunks in [&[300][..], &[100, 2, 198]] {
        let (a, b) = (
            forward_all(&with, &ids, chunks),
            forward_all(&without, &ids, chunks),
        );
        assert_eq!(a, b, "chunks {chunks:?}");
    }
    let batched = |dec: &Decoder<CudaBackend>| {
        let (mut ca, mut cb) = (dec.new_cache(), dec.new_cache());
        forward_batch(
            dec,
            vec![
                (&ids, &mut ca, LogitsRequest::All),
                (&other, &mut cb, LogitsRequest::All),
            ],
        )
    };
    assert_eq!(batched(&with), batched(&without), "batched");
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
/// scale per 32 inputs at 4 bits, 16 at 8 bits) for byte dot products; chunks of 3 to 256
/// rows on the tensor-core kernel that dequantizes in registers (weights and inputs rounded
/// to f16; `affine_products_of_many_rows_match_the_cpu` checks it op by op), longer ones
/// dequantize to bf16 for cuBLAS (weights and inputs rounded to bf16). All stay
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
    let w = DeltaWeights::new(REAL_HEADS);
    let p = w.params();
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
    assert_states_close("DeltaNet 128", &got_states, &want_states);
}

/// The real models' DeltaNet head sizes: 128 key and value dimensions, two value heads per
/// key head (the state's every register row and column block, which the tiny goldens'
/// 16 × 24 heads do not reach).
const REAL_HEADS: DeltaShape = DeltaShape {
    k_heads: 2,
    v_heads: 4,
    k_dim: 128,
    v_dim: 128,
    conv_kernel: 4,
};

/// Seeded weights of one DeltaNet layer.
struct DeltaWeights {
    shape: DeltaShape,
    conv: Vec<f32>,
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
}

impl DeltaWeights {
    fn new(shape: DeltaShape) -> Self {
        let conv = noise(shape.conv_dim() * shape.conv_kernel, 1)
            .iter()
            .map(|w| w * 0.5)
            .collect();
        // Decays per token between about 0.1 and 0.998 (by head and token): in the slow
        // heads what earlier chunks left in the state still counts 64 tokens on.
        let neg_a = noise(shape.v_heads, 2)
            .iter()
            .map(|x| -(2.0 * x - 2.0).exp())
            .collect();
        let norm = noise(shape.v_dim, 4)
            .iter()
            .map(|x| 1.0 + 0.1 * x)
            .collect();
        DeltaWeights {
            shape,
            conv,
            neg_a,
            dt_bias: noise(shape.v_heads, 3),
            norm,
        }
    }

    fn params(&self) -> DeltaParams<'_> {
        DeltaParams {
            shape: self.shape,
            conv: &self.conv,
            neg_a: &self.neg_a,
            dt_bias: &self.dt_bias,
            norm: &self.norm,
            eps: 1e-6,
        }
    }
}

fn assert_states_close(what: &str, got: &[DeltaState], want: &[DeltaState]) {
    assert_eq!(got.len(), want.len(), "{what}: sequences");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_close(
            what,
            &format!("sequence {i}'s convolution state"),
            &g.conv,
            &w.conv,
        );
        assert_close(
            what,
            &format!("sequence {i}'s delta-rule state"),
            &g.ssm,
            &w.ssm,
        );
    }
}

/// The chunked form over long segments at the real head sizes against the host's mixer:
/// one batch of segments of 1, 63, 64, 65, 700 and 2,100 rows (a row short of, exactly at
/// and one past a 64-token chunk, many chunks with a partial last one), then the same
/// sequences continuing from the states that left (none of them zero) in segments of other
/// lengths, then a decode row each. Every segment's output is compared on its own, so a
/// failure names the pass and the segment's length.
#[test]
fn qwen35_deltanet_chunked_long_segments_match_the_host() {
    let Some(cuda) = gpu() else { return };
    let cpu = CandleBackend::cpu();
    let w = DeltaWeights::new(REAL_HEADS);
    let p = w.params();
    let vt = REAL_HEADS.v_heads * REAL_HEADS.v_dim;
    let passes: [&[usize]; 3] = [
        &[1, 63, 64, 65, 700, 2100],
        &[2100, 65, 130, 1, 63, 17],
        &[1, 1, 1, 1, 1, 1],
    ];
    let (got, got_states) = mix_passes(&cuda, &p, &passes);
    let (want, want_states) = mix_passes(&cpu, &p, &passes);
    for (i, rows) in passes.iter().enumerate() {
        let mut at = 0;
        for (j, &r) in rows.iter().enumerate() {
            let span = at * vt..(at + r) * vt;
            assert_close(
                "DeltaNet chunked",
                &format!("pass {i} sequence {j} ({r} rows of {rows:?})"),
                &got[i][span.clone()],
                &want[i][span],
            );
            at += r;
        }
    }
    assert_states_close("DeltaNet chunked", &got_states, &want_states);
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
/// stays on the CUDA-core kernel), keys split into parts, the wide kernels of long chunks;
/// f32 and f16 caches. Exact: as f32 (within 2e-5 of the outputs' scale); fast (f16
/// products): within 5e-3.
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
        // Chunks of 128 rows or more take the wide kernels (two m-tiles a warp) at head
        // sizes up to 128: groups of 7 leave units of a block's last m-tile empty, no
        // grouping fills a tile with 128 rows, groups of 32 give 4 rows a tile and split
        // the keys.
        (14, 2, 64, Some(333), None, 1000, 300, true),
        (4, 4, 80, None, Some(20.0), 700, 150, true),
        (32, 1, 128, None, None, 3000, 130, false),
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
    exact_flash_for_loaded_models();
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
/// the host one sequence at a time and three at once (replayed as CUDA graphs, the MoE
/// layers' routing included), and in lockstep with the ids kept on the device
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
        assert!(
            stats.replayed > 0,
            "{variant}: no decode step was replayed from a graph"
        );
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

/// `values` `[experts, rows, cols]` as an expert weight of `dtype` (f32 or bf16).
fn expert_weight(
    name: &str,
    shape: [usize; 3],
    values: &[f32],
    dtype: GgmlType,
) -> HostWeight<'static> {
    let bytes: Vec<u8> = match dtype {
        GgmlType::Bf16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    HostWeight {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        bytes: std::borrow::Cow::Owned(bytes),
    }
}

/// One MoE shape: `experts` of `hidden -> inner`, top `k`, weights of `dtype`, on `rows`
/// rows: the CUDA backend's device routing and expert products (mat-vecs for decode rows,
/// the expert-sorted grouped product for more) against the CPU backend's host path, each
/// run as one tape (nothing read back to the host mid-pass).
fn moe_matches_the_cpu(
    cuda: &CudaBackend,
    (experts, k, hidden, inner): (usize, usize, usize, usize),
    dtype: GgmlType,
    row_counts: &[usize],
    bound: f32,
) {
    let what = format!("MoE {experts} experts top {k}, {hidden} -> {inner}, {dtype:?}");
    let cpu = CandleBackend::cpu();
    // bf16 weights: the CPU gets their exact values as f32.
    let round = |v: Vec<f32>| -> Vec<f32> {
        match dtype {
            GgmlType::Bf16 => v
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect(),
            _ => v,
        }
    };
    let gu_values = round(noise(experts * 2 * inner * hidden, 11));
    let down_values = round(noise(experts * hidden * inner, 12));
    let scale: Vec<f32> = noise(experts, 13).iter().map(|s| 1.0 + 0.5 * s).collect();
    let gu_shape = [experts, 2 * inner, hidden];
    let down_shape = [experts, hidden, inner];
    let (on_gpu, _) = Experts::upload(
        cuda,
        &expert_weight("gate_up", gu_shape, &gu_values, dtype),
        &expert_weight("down", down_shape, &down_values, dtype),
        scale.clone(),
        k,
        Activation::GeluTanh,
    )
    .unwrap();
    assert!(
        on_gpu.stacked().is_some(),
        "{what}: the experts were not stacked on the device"
    );
    let (on_cpu, _) = Experts::upload(
        &cpu,
        &expert_weight("gate_up", gu_shape, &gu_values, GgmlType::F32),
        &expert_weight("down", down_shape, &down_values, GgmlType::F32),
        scale,
        k,
        Activation::GeluTanh,
    )
    .unwrap();
    for &rows in row_counts {
        // Inputs of about unit RMS (a norm's output) and logits spread like a router's.
        let x = noise(rows * hidden, 20 + rows as u64);
        let logits: Vec<f32> = noise(rows * experts, 40 + rows as u64)
            .iter()
            .map(|l| 4.0 * l)
            .collect();
        let want = {
            let x = cpu.tensor_from_host(x.clone(), rows, hidden).unwrap();
            let l = cpu.tensor_from_host(logits.clone(), rows, experts).unwrap();
            let y = cpu.moe(&on_cpu, &x, &l, rows).unwrap();
            cpu.rows_to_host(&y, &[rows]).unwrap().concat()
        };
        let xg = cuda.tensor_from_host(x, rows, hidden).unwrap();
        let lg = cuda.tensor_from_host(logits, rows, experts).unwrap();
        let before = cuda.device().stats();
        let y = cuda.pass(|| cuda.moe(&on_gpu, &xg, &lg, rows)).unwrap();
        let after = cuda.device().stats();
        let tapes = (after.eager + after.captured + after.replayed)
            - (before.eager + before.captured + before.replayed);
        assert_eq!(
            tapes, 1,
            "{what}, {rows} rows: the pass ran as {tapes} tapes (something read the host mid-pass)"
        );
        let got = cuda.rows_to_host(&y, &[rows]).unwrap().concat();
        assert!(
            want.iter().any(|v| v.abs() > 1e-2),
            "{what}: a zero reference"
        );
        let (w, scale) = worst(&got, &want);
        eprintln!("{what}, {rows} rows: max |diff| {w:.2e} (scale {scale:.1})");
        assert!(
            w <= bound * scale,
            "{what}, {rows} rows: max |diff| {w} > {bound} × {scale}"
        );
    }
}

/// The mixture-of-experts op on the device against the CPU backend on random weights: a
/// real-ish shape (16 experts, top 4, 256 -> 64) in f32 and bf16 at 1 and 3 rows (the
/// routed mat-vecs) and 40 (the grouped product, several experts' tiles), and sizes that
/// are no multiple of 8 (the kernels' scalar loads) with more than one tile for an expert.
///
/// bf16 experts' grouped products run on the tensor cores by default, their inputs rounded
/// to bf16 as a dense layer's cuBLAS product rounds them: held to 1% of the output scale
/// (one bf16 rounding of each input of two products), and to the f32 bound on the CUDA
/// cores (`with_moe_mma(false)`).
#[test]
fn moe_routing_and_experts_match_the_cpu() {
    let Some(cuda) = gpu() else { return };
    for dtype in [GgmlType::F32, GgmlType::Bf16] {
        moe_matches_the_cpu(&cuda, (16, 4, 256, 64), dtype, &[1, 3], TOLERANCE);
    }
    moe_matches_the_cpu(&cuda, (16, 4, 256, 64), GgmlType::F32, &[40], TOLERANCE);
    moe_matches_the_cpu(&cuda, (16, 4, 256, 64), GgmlType::Bf16, &[40, 300], 1e-2);
    // Tiles of several experts, a partial column tile (inner 72) and a partial input step.
    moe_matches_the_cpu(&cuda, (8, 2, 200, 72), GgmlType::Bf16, &[150], 1e-2);
    moe_matches_the_cpu(
        &cuda,
        (5, 2, 100, 36),
        GgmlType::F32,
        &[1, 2, 200],
        TOLERANCE,
    );
    drop(cuda);
    let Some(exact) = gpu().map(|c| c.with_moe_mma(false)) else {
        return;
    };
    moe_matches_the_cpu(&exact, (16, 4, 256, 64), GgmlType::Bf16, &[40], TOLERANCE);
}

/// The ops the media towers add (rotary tables of per-axis positions, LayerNorm with and
/// without a bias, an ungated activation) against the CPU backend's, on `be`: each op's
/// output on the host.
fn tower_ops<B: Backend>(be: &B) -> Vec<(String, Vec<f32>)> {
    let mut outs = Vec::new();
    // M-RoPE: 40 rows (an image's grid, then text whose three components agree) of 4 heads
    // of 32, the 16 frequencies split over the axes as Qwen's sections split them.
    let rows = 40;
    let positions: Vec<[usize; 3]> = (0..rows)
        .map(|r| match r {
            0..=23 => [3, 3 + r / 6, 3 + r % 6],
            _ => [r - 15, r - 15, r - 15],
        })
        .collect();
    let axes: Vec<u8> = (0..16).map(|i| [0, 1, 1, 2, 2][i % 5]).collect();
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        let spec = RopeSpec {
            style,
            dims: 32,
            inv_freq: RopeSpec::base_inv_freq(10_000.0, 32),
            position_scale: 1.0,
            attention_factor: 1.0,
        };
        let table = be.rope_table_axes(&positions, &axes, &spec).unwrap();
        let x = be
            .tensor_from_host(noise(rows * 128, 1), rows, 128)
            .unwrap();
        let k = be.tensor_from_host(noise(rows * 64, 2), rows, 64).unwrap();
        let (q, k) = be.rope_qk(&x, 4, &k, 2, &table).unwrap();
        let one = be.rope(&x, 4, &table).unwrap();
        // A fused q/k/v product's split and rotation in one op.
        let qkv = be
            .tensor_from_host(noise(rows * 256, 6), rows, 256)
            .unwrap();
        let (fq, fk, fv) = be
            .split_rope_qkv(&qkv, &[128, 64, 64], 4, 2, &table)
            .unwrap();
        for (what, t) in [
            ("rope_qk q", &q),
            ("rope_qk k", &k),
            ("rope", &one),
            ("split_rope_qkv q", &fq),
            ("split_rope_qkv k", &fk),
            ("split_rope_qkv v", &fv),
        ] {
            outs.push((
                format!("{what} ({style:?}) of M-RoPE positions"),
                be.rows_to_host(t, &[rows]).unwrap().remove(0),
            ));
        }
    }
    // LayerNorm over widths a block covers from registers, and past them.
    for n in [24, 1152, 9000] {
        let rows = 3;
        let x: Vec<f32> = noise(rows * n, 3).iter().map(|v| 4.0 * v + 1.5).collect();
        let x = be.tensor_from_host(x, rows, n).unwrap();
        let w = be.tensor_from_host(noise(n, 4), 1, n).unwrap();
        let b = be.tensor_from_host(noise(n, 5), 1, n).unwrap();
        for bias in [None, Some(&b)] {
            let y = be.layer_norm(&x, &w, bias, 1e-6).unwrap();
            outs.push((
                format!("layer_norm of {n} (bias: {})", bias.is_some()),
                be.rows_to_host(&y, &[rows]).unwrap().remove(0),
            ));
        }
    }
    let x: Vec<f32> = noise(5 * 77, 6).iter().map(|v| 6.0 * v).collect();
    let x = be.tensor_from_host(x, 5, 77).unwrap();
    for act in [Activation::GeluTanh, Activation::Silu] {
        let y = be.activation(&x, act).unwrap();
        outs.push((
            format!("activation {act:?}"),
            be.rows_to_host(&y, &[5]).unwrap().remove(0),
        ));
    }
    outs
}

/// M-RoPE tables, LayerNorm and the ungated activation on the GPU give the CPU backend's
/// values; a table of per-axis positions whose axes agree is the plain table.
#[test]
fn tower_ops_match_the_cpu() {
    let Some(be) = gpu() else { return };
    let cpu = CandleBackend::cpu();
    for ((what, got), (_, want)) in tower_ops(&be).into_iter().zip(tower_ops(&cpu)) {
        assert_close("tower ops", &what, &got, &want);
    }
    let spec = RopeSpec {
        style: RopeStyle::Neox,
        dims: 16,
        inv_freq: RopeSpec::base_inv_freq(1e6, 16),
        position_scale: 1.0,
        attention_factor: 1.0,
    };
    let positions: Vec<usize> = (100..109).collect();
    let triples: Vec<[usize; 3]> = positions.iter().map(|&p| [p; 3]).collect();
    let x = be.tensor_from_host(noise(9 * 32, 7), 9, 32).unwrap();
    let plain = be.rope(&x, 2, &be.rope_table(&positions, &spec).unwrap());
    let axes = be.rope(
        &x,
        2,
        &be.rope_table_axes(&triples, &[0, 1, 2, 0, 1, 2, 0, 1], &spec)
            .unwrap(),
    );
    assert_eq!(
        be.rows_to_host(&plain.unwrap(), &[9]).unwrap(),
        be.rows_to_host(&axes.unwrap(), &[9]).unwrap(),
        "M-RoPE table of agreeing axes"
    );
    // Bad axes are refused as on the CPU.
    for axes in [&[0u8; 7][..], &[0, 1, 2, 3, 0, 1, 2, 0]] {
        let err = be.rope_table_axes(&triples, axes, &spec).err().unwrap();
        assert!(err.to_string().contains("rotary axes"), "{err}");
    }
}

/// Rotary tables of prompt length, which the CUDA backend computes on the device (a decode
/// step's few rows it computes on the host), rotate as the CPU backend's: plain positions
/// with linear scaling and an attention factor, Gemma 4's proportional frequencies (the
/// last ones zero) at 512 dimensions, and M-RoPE axes.
#[test]
fn long_rotary_tables_match_the_cpu() {
    let Some(be) = gpu() else { return };
    let cpu = CandleBackend::cpu();
    fn rotated<B: Backend>(be: &B) -> Vec<(String, Vec<f32>)> {
        let mut outs = Vec::new();
        let mut proportional = RopeSpec::base_inv_freq(1e6, 512);
        proportional[64..].iter_mut().for_each(|f| *f = 0.0);
        let specs = [
            (
                "plain 256",
                256,
                RopeSpec::base_inv_freq(1e4, 256),
                0.5,
                1.1,
                0..4096,
            ),
            (
                "proportional 512",
                512,
                proportional,
                1.0,
                1.0,
                60_000..60_100,
            ),
        ];
        for (what, dims, inv_freq, position_scale, attention_factor, range) in specs {
            let spec = RopeSpec {
                style: RopeStyle::Neox,
                dims,
                inv_freq,
                position_scale,
                attention_factor,
            };
            let positions: Vec<usize> = range.collect();
            let rows = positions.len();
            let x = be
                .tensor_from_host(noise(rows * 2 * dims, 11), rows, 2 * dims)
                .unwrap();
            let y = be
                .rope(&x, 2, &be.rope_table(&positions, &spec).unwrap())
                .unwrap();
            outs.push((
                what.to_string(),
                be.rows_to_host(&y, &[rows]).unwrap().remove(0),
            ));
        }
        let rows = 600;
        let positions: Vec<[usize; 3]> = (0..rows).map(|r| [r, r / 24, r % 24 + 7]).collect();
        let axes: Vec<u8> = (0..16).map(|i| [0, 1, 1, 2, 2][i % 5]).collect();
        let spec = RopeSpec {
            style: RopeStyle::Interleaved,
            dims: 32,
            inv_freq: RopeSpec::base_inv_freq(1e4, 32),
            position_scale: 1.0,
            attention_factor: 1.0,
        };
        let x = be.tensor_from_host(noise(rows * 64, 12), rows, 64).unwrap();
        let table = be.rope_table_axes(&positions, &axes, &spec).unwrap();
        let y = be.rope(&x, 2, &table).unwrap();
        outs.push((
            "M-RoPE".into(),
            be.rows_to_host(&y, &[rows]).unwrap().remove(0),
        ));
        outs
    }
    for ((what, got), (_, want)) in rotated(&be).into_iter().zip(rotated(&cpu)) {
        let (w, _) = worst(&got, &want);
        eprintln!("rotary table {what}: max |diff| {w:.2e}");
        assert!(w <= 1e-5, "rotary table {what}: max |diff| {w}");
    }
}

/// The fused norm ops of a decoder layer on `be`: per-head q/k(/v) norms with the rotation
/// (`norm_rope_qkv`: head sizes 64, 256 and 512, both rotation styles, a partial rotation,
/// with and without keys and values) and a post-norm joining the residual with the next
/// norm (`add_post_norm`: widths a block holds in registers and past them, scaled or not).
fn norm_ops<B: Backend>(be: &B) -> Vec<(String, Vec<f32>)> {
    let mut outs = Vec::new();
    let rows = 3;
    let positions: Vec<usize> = vec![0, 17, 4_000];
    for (hd, dims, style) in [
        (64, 64, RopeStyle::Neox),
        (64, 16, RopeStyle::Interleaved),
        (256, 256, RopeStyle::Neox),
        (512, 128, RopeStyle::Neox),
    ] {
        let spec = RopeSpec {
            style,
            dims,
            inv_freq: RopeSpec::base_inv_freq(10_000.0, dims),
            position_scale: 1.0,
            attention_factor: 1.0,
        };
        let table = be.rope_table(&positions, &spec).unwrap();
        let (heads, kv_heads) = (4, 2);
        let tensor = |n: usize, seed: u64, cols: usize| {
            let x: Vec<f32> = noise(n, seed).iter().map(|v| 3.0 * v + 0.5).collect();
            be.tensor_from_host(x, n / cols, cols).unwrap()
        };
        let q = tensor(rows * heads * hd, 11, heads * hd);
        let k = tensor(rows * kv_heads * hd, 12, kv_heads * hd);
        let v = tensor(rows * kv_heads * hd, 13, kv_heads * hd);
        let (qw, kw, vw) = (tensor(hd, 14, hd), tensor(hd, 15, hd), tensor(hd, 16, hd));
        let cases = [
            ("q, k and v", Some((&k, &kw)), Some((&v, &vw))),
            ("q and k", Some((&k, &kw)), None),
            ("q alone", None, None),
        ];
        for (what, kk, vv) in cases {
            let out = be
                .norm_rope_qkv((&q, &qw), kk, vv, heads, kv_heads, &table, 1e-6)
                .unwrap();
            for (part, t) in [
                ("q", Some(&out.q)),
                ("k", out.k.as_ref()),
                ("v", out.v.as_ref()),
            ] {
                if let Some(t) = t {
                    outs.push((
                        format!(
                            "norm_rope_qkv {what}: {part} (head {hd}, {dims} rotated, {style:?})"
                        ),
                        be.rows_to_host(t, &[rows]).unwrap().remove(0),
                    ));
                }
            }
        }
    }
    // Two or three matrices multiplying one or two rows (one launch on the GPU), of each
    // dense type, odd output counts among them.
    for dtype in [GgmlType::F32, GgmlType::Bf16] {
        let cols = 136;
        let shapes = [96, 33, 33];
        let ms: Vec<B::Matrix> = shapes
            .iter()
            .enumerate()
            .map(|(i, &out)| {
                let values = noise(out * cols, 30 + i as u64);
                let w = expert_weight("w", [1, out, cols], &values, dtype);
                let w = HostWeight {
                    shape: vec![out, cols],
                    ..w
                };
                be.matrix(w).unwrap()
            })
            .collect();
        for (n, xrows) in [(3, 1), (3, 2), (2, 1), (2, 2)] {
            let x = be
                .tensor_from_host(noise(xrows * cols, 40), xrows, cols)
                .unwrap();
            let ws: Vec<_> = ms.iter().take(n).map(|m| (m, None)).collect();
            let ys = be.pass(|| be.linear_many(&x, &ws)).unwrap();
            assert_eq!(ys.len(), n);
            for (i, y) in ys.iter().enumerate() {
                outs.push((
                    format!("linear_many of {n} ({dtype:?}, {xrows} rows): product {i}"),
                    be.rows_to_host(y, &[xrows]).unwrap().remove(0),
                ));
            }
        }
        // A product gating another tensor (Gemma 4's per-layer inputs): one launch for one
        // or two rows on the GPU, the product and the GLU for more (f32 weights only: more
        // rows of bf16 weights take cuBLAS, whose inputs are rounded to bf16).
        for xrows in [1, 2, 5] {
            if xrows > 2 && dtype == GgmlType::Bf16 {
                continue;
            }
            let x = be
                .tensor_from_host(noise(xrows * cols, 41), xrows, cols)
                .unwrap();
            let mul = be
                .tensor_from_host(noise(xrows * 33, 42), xrows, 33)
                .unwrap();
            for act in [Activation::GeluTanh, Activation::Silu] {
                let y = be
                    .pass(|| be.linear_act_mul(&x, &ms[1], &mul, act))
                    .unwrap();
                outs.push((
                    format!("linear_act_mul ({dtype:?}, {xrows} rows, {act:?})"),
                    be.rows_to_host(&y, &[xrows]).unwrap().remove(0),
                ));
            }
        }
    }
    for n in [24, 2560, 9000] {
        let x = be.tensor_from_host(noise(rows * n, 21), rows, n).unwrap();
        let y: Vec<f32> = noise(rows * n, 22).iter().map(|v| 5.0 * v - 1.0).collect();
        let y = be.tensor_from_host(y, rows, n).unwrap();
        let post = be.tensor_from_host(noise(n, 23), 1, n).unwrap();
        let next = be.tensor_from_host(noise(n, 24), 1, n).unwrap();
        for (scale, with_next) in [(1.0, true), (1.0, false), (0.625, true)] {
            let (sum, normed) = be
                .add_post_norm(&x, &y, &post, 1e-6, scale, with_next.then_some(&next))
                .unwrap();
            assert_eq!(normed.is_some(), with_next);
            for (part, t) in [("sum", Some(&sum)), ("next norm", normed.as_ref())] {
                if let Some(t) = t {
                    outs.push((
                        format!("add_post_norm of {n} (scale {scale}): {part}"),
                        be.rows_to_host(t, &[rows]).unwrap().remove(0),
                    ));
                }
            }
        }
    }
    outs
}

/// The fused norm kernels give the CPU backend's values (which runs them as separate norms,
/// rotations and adds).
#[test]
fn fused_norm_ops_match_the_cpu() {
    let Some(be) = gpu() else { return };
    let cpu = CandleBackend::cpu();
    let (got, want) = (norm_ops(&be), norm_ops(&cpu));
    assert_eq!(got.len(), want.len());
    for ((what, got), (_, want)) in got.into_iter().zip(want) {
        assert_close("norm ops", &what, &got, &want);
    }
}

/// A media golden (`tests/common/media.rs`): its name, how its cases' media are built, the
/// cases compared at every position, the case `generate()` continues (transformers'
/// greedy continuation) and the text-only case batched beside it.
struct MediaCheck {
    golden: &'static str,
    media_of: MediaOf,
    cases: &'static [&'static str],
    greedy: &'static str,
    text: Option<&'static str>,
}

/// A vision golden whose greedy case is `one_image`, batched beside `text_only`.
const fn vision(
    golden: &'static str,
    media_of: MediaOf,
    cases: &'static [&'static str],
) -> MediaCheck {
    MediaCheck {
        golden,
        media_of,
        cases,
        greedy: "one_image",
        text: Some("text_only"),
    }
}

const IMAGE_CASES: &[&str] = &["one_image", "two_images", "text_only"];
const QWEN_CASES: &[&str] = &[
    "one_image",
    "two_images",
    "text_only",
    "text_then_images",
    "image_then_turns",
];

const MEDIA_GOLDENS: [MediaCheck; 8] = [
    vision("gemma3_vision", gemma3_media, IMAGE_CASES),
    vision("gemma4_vision", gemma4_media, IMAGE_CASES),
    vision("gemma4_vision_bidir", gemma4_media, IMAGE_CASES),
    MediaCheck {
        text: None,
        ..vision("gemma4_vision_clipped", gemma4_media, &["one_image"])
    },
    MediaCheck {
        greedy: "mono",
        ..vision(
            "gemma4_audio",
            audio_media,
            &["mono", "stereo", "text_only"],
        )
    },
    MediaCheck {
        greedy: "both",
        text: None,
        ..vision("gemma4_audio_vision", gemma4_image_and_clip, &["both"])
    },
    vision("qwen35_vision", qwen_media, QWEN_CASES),
    vision("qwen25_vl", qwen_media, QWEN_CASES),
];

/// Media golden `c` loaded on the GPU as `wick serve --backend cuda` loads it, held to the
/// GPU's tolerance; `None` without a GPU. Fails if a tower it has was left out.
fn cuda_media(c: &MediaCheck) -> Option<MediaGolden> {
    gpu()?;
    let options = LoadOptions {
        backend: BackendKind::Cuda,
        ..LoadOptions::default()
    };
    let g =
        MediaGolden::open_with(c.golden, c.media_of, &options).within(Tolerance::Scaled(TOLERANCE));
    let support = g.model.support();
    for (tower, loaded, why) in [
        (
            "vision",
            g.model.info().media.vision.is_some(),
            &support.vision,
        ),
        (
            "audio",
            g.model.info().media.audio.is_some(),
            &support.audio,
        ),
    ] {
        if let Some(why) = why {
            assert!(
                loaded && why.is_ok(),
                "{}: the {tower} tower was left out on CUDA: {why:?}",
                c.golden
            );
        }
    }
    Some(g)
}

/// Every media golden on the GPU against transformers' logits at every position: in one
/// pass (an image's tower and its soft tokens' attention on the flash kernels), and in
/// chunks (each moved so it cuts no media item; chunks of one row are decode steps, whose
/// M-RoPE tables come from per-axis positions shifted by the images).
#[test]
fn media_goldens_match_transformers_in_one_pass_and_in_chunks() {
    for c in &MEDIA_GOLDENS {
        let Some(g) = cuda_media(c) else { return };
        g.chunked_matches(c.cases, &[usize::MAX, 5, 13]);
        g.chunked_matches(&c.cases[..1], &[1]);
    }
}

/// The audio tower's projected rows of both clips, on a model loaded on the GPU.
#[test]
fn audio_tower_rows_match_transformers_on_cuda() {
    let Some(g) = cuda_media(&MEDIA_GOLDENS[4]) else {
        return;
    };
    for (case, clip) in [("mono", "mono16k"), ("stereo", "stereo44k")] {
        let rows = g.model.media_rows(&g.media(case)).unwrap();
        assert_eq!(rows.len(), 1, "{case}");
        check_close(
            &format!("gemma4_audio {clip} tower rows"),
            &rows[0],
            &floats(&g.logits, &format!("{clip}.rows")),
            Tolerance::Scaled(TOLERANCE),
            |i| format!("value {i}"),
        );
    }
}

/// An image (or clip) row prefilled in one batch beside a text row: both rows' logits
/// match transformers', and the two decode a step together.
#[test]
fn media_rows_batched_beside_text_rows_match_transformers() {
    for c in &MEDIA_GOLDENS {
        let Some(text) = c.text else { continue };
        let Some(g) = cuda_media(c) else { return };
        g.batch_beside_text(c.golden, c.greedy, text);
    }
}

/// Greedy decoding through `generate()` after a prompt holding an image (or clip), on the
/// GPU: the CPU backend's tokens for 24 steps (the decode steps of a fixed batch, whose
/// M-RoPE positions are shifted by the images, replay as graphs), and transformers'
/// greedy continuation where it has one.
#[test]
fn media_greedy_decoding_matches_the_cpu_and_transformers() {
    const STEPS: usize = 24;
    for c in &MEDIA_GOLDENS {
        let Some(cuda) = cuda_media(c) else { return };
        let cpu = MediaGolden::open(c.golden, c.media_of);
        let generate = |g: &MediaGolden| {
            g.model
                .generate(&g.request(c.greedy, STEPS), |_| {
                    std::ops::ControlFlow::Continue(())
                })
                .unwrap()
                .tokens
        };
        let (got, want) = (generate(&cuda), generate(&cpu));
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(
            got, want,
            "{} {}: the CPU backend's greedy tokens (first difference at step {first:?})",
            c.golden, c.greedy
        );
        if cuda.reference.get("greedy").is_some() {
            let reference = cuda.greedy();
            let n = reference.len().min(STEPS);
            assert_eq!(
                got[..n],
                reference[..n],
                "{} {}: transformers' greedy continuation",
                c.golden,
                c.greedy
            );
        }
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

/// Affine products of 3 to 256 rows on the device against the CPU backend's product of the
/// same weights (dequantized to f32, f32 inputs): the int8 tensor-core kernel (x quantized
/// to int8 in blocks of 32, up to 64 rows in one tile of 8, 16, 32 or 64 rows, 200 in four
/// tiles of 64), the tensor-core kernel that dequantizes
/// in registers (x and weights rounded to f16; x rounded once per product, up to 8 rows in
/// tiles of 8 or of 16, and by every block as before) and, with it switched off, the bf16 copy for
/// cuBLAS; plain products with a bias and the fused `[gate; up]` form. 4 and 8 bits, groups
/// of 32, 64 and 128 with bf16, f16 and f32 scales; inputs that are no multiple of the
/// kernel's 256-input slabs, with and without the inputs split between blocks; outputs that
/// are no multiple of its 64-output tiles; rows that fill one tile of 16, 32 or 64 and span
/// several.
#[test]
fn affine_products_of_many_rows_match_the_cpu() {
    let Some(imma) = gpu().map(|b| b.with_quant_mma(true).with_quant_imma_rows(256)) else {
        return;
    };
    let Some(mma) = gpu().map(|b| {
        b.with_quant_mma(true)
            .with_quant_mma_rounding_once(true)
            .with_quant_mma_tile8(true)
            .with_quant_imma_rows(0)
    }) else {
        return;
    };
    let Some(tile16) = gpu().map(|b| {
        b.with_quant_mma(true)
            .with_quant_mma_rounding_once(true)
            .with_quant_mma_tile8(false)
            .with_quant_imma_rows(0)
    }) else {
        return;
    };
    let Some(per_block) = gpu().map(|b| {
        b.with_quant_mma(true)
            .with_quant_mma_rounding_once(false)
            .with_quant_imma_rows(0)
    }) else {
        return;
    };
    let Some(blas) = gpu().map(|b| b.with_quant_mma(false)) else {
        return;
    };
    let cpu = CandleBackend::cpu();
    let cases = [
        (4, 32, GgmlType::F16),
        (8, 32, GgmlType::Bf16),
        (4, 64, GgmlType::Bf16),
        (8, 64, GgmlType::F32),
        (4, 128, GgmlType::F32),
        (8, 128, GgmlType::F16),
    ];
    let mut seed = 100;
    for (bits, group, side) in cases {
        // A short row (less than one slab: one slice) and a long one (several slices).
        for (out, cols) in [(72, 3 * group), (136, 2304 + group)] {
            seed += 1;
            let values = noise(out * cols, seed);
            let bias = noise(out, seed + 1000);
            let quantized = || {
                wick_engine::weights::AffineWeight::quantize(
                    "w",
                    &values,
                    (out, cols),
                    (bits, group),
                    side,
                )
                .unwrap()
            };
            let on_cpu = cpu.affine_matrix(quantized()).unwrap();
            let gpus = [
                ("int8 tensor cores", &imma),
                ("tensor cores", &mma),
                ("tensor cores, tiles of 16 rows", &tile16),
                ("tensor cores, x rounded per block", &per_block),
                ("bf16 copy for cuBLAS", &blas),
            ];
            let on_gpu = gpus.map(|(what, be)| (what, be, be.affine_matrix(quantized()).unwrap()));
            for rows in [3, 8, 13, 17, 64, 200] {
                let x = noise(rows * cols, seed + rows as u64);
                let (want, want_glu) = {
                    let xc = cpu.tensor_from_host(x.clone(), rows, cols).unwrap();
                    let bc = cpu.tensor_from_host(bias.clone(), 1, out).unwrap();
                    let y = cpu.linear(&xc, &on_cpu, Some(&bc)).unwrap();
                    let g = cpu
                        .linear_glu(&xc, &on_cpu, out / 2, Activation::Silu)
                        .unwrap();
                    (
                        cpu.rows_to_host(&y, &[rows]).unwrap().concat(),
                        cpu.rows_to_host(&g, &[rows]).unwrap().concat(),
                    )
                };
                for (path, be, m) in &on_gpu {
                    let what = format!(
                        "{bits}-bit groups of {group} ({side}), {out}x{cols}, {rows} rows, {path}"
                    );
                    let xg = be.tensor_from_host(x.clone(), rows, cols).unwrap();
                    let bg = be.tensor_from_host(bias.clone(), 1, out).unwrap();
                    let y = be.pass(|| be.linear(&xg, m, Some(&bg))).unwrap();
                    let g = be
                        .pass(|| be.linear_glu(&xg, m, out / 2, Activation::Silu))
                        .unwrap();
                    for (op, got, want) in [
                        (
                            "linear + bias",
                            be.rows_to_host(&y, &[rows]).unwrap(),
                            &want,
                        ),
                        ("gate/up", be.rows_to_host(&g, &[rows]).unwrap(), &want_glu),
                    ] {
                        let got = got.concat();
                        assert_eq!(got.len(), want.len(), "{what} {op}: output size");
                        let (w, scale) = worst(&got, want);
                        eprintln!("{what} {op}: max |diff| {w:.2e} (scale {scale:.1})");
                        // x in int8 (blocks of 32) is off by up to 1/254 of its block's
                        // largest value, ten times f16's rounding: the bound the model-level
                        // test holds the quantized products to.
                        let bound = if path.starts_with("int8") { 3e-2 } else { 1e-2 };
                        assert!(
                            w <= bound * scale,
                            "{what} {op}: max |diff| {w} > {bound} × {scale} against the CPU"
                        );
                    }
                }
            }
        }
    }
}
