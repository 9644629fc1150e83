//! Qwen 3.5 (gated DeltaNet hybrids) and Gemma 4 (text, MoE: KV sharing, per-layer inputs,
//! proportional rotary, soft caps, expert routing; images), the other vision towers and the
//! dense families of optional ops (Mistral, Phi-3, StarCoder 2), on the MLX backend, on MLX's CPU
//! device in f32, against transformers' logits of the tiny goldens (`tests/goldens/hf`) and
//! the CPU backend: every position in one pass and in chunks, batches of sequences of
//! different lengths, greedy tokens, DeltaNet states copied, cloned and rebuilt from the
//! host (the prompt cache's tiers), Gemma 4's audio rows and images placed in the pass, and
//! PEFT adapters on both families. Needs `--features mlx`.
#![cfg(feature = "mlx")]
mod common;

use common::golden::{decoder_from_dir, golden_dir, ids_of, read_json, CpuGolden, TextGolden};
use common::hybrid_adapters::{
    all_with, mixed_batch, upload, ExpertAdapters, HybridAdapters, MODELS,
};
use common::logits::{forward_all, forward_batch, greedy_decode, pass, worst};
use common::media::cases::{gemma3_media, gemma4_media, qwen_media};
use common::media::{audio_media, MediaGolden, MediaOf};
use wick_engine::backend::candle::CandleBackend;
use wick_engine::backend::mlx::{DeltaNetPlace, Dtype, MlxBackend, MlxDevice};
use wick_engine::backend::BackendKind;
use wick_engine::backend::{
    Backend, DeltaInputs, DeltaParams, DeltaSegment, DeltaShape, DeltaState, DeltaStore,
};
use wick_engine::models::decoder::{BatchItem, Decoder, LogitsRequest, RowOutput, Want};
use wick_engine::LoadOptions;

/// Qwen 3.5's tiny hybrids: DeltaNet layers (2 key heads of 16, 4 value heads of 24, a
/// convolution of width 4) around a gated full-attention layer.
const HYBRIDS: [&str; 2] = ["qwen35", "qwen35_tied"];
/// Gemma 4's: the e2b shape (per-layer inputs, KV sharing, sliding and full layers of their
/// own head sizes, proportional rotary, a final soft cap) and the 26B-A4B shape (experts
/// routed on the host, `attention_k_eq_v`).
const GEMMAS: [&str; 2] = ["gemma4", "gemma4_moe"];
/// What MLX's f32 products may differ from transformers' by, relative to the largest logit
/// (the CPU backend's bound).
const TOLERANCE: f32 = 1e-4;

/// MLX's CPU device in f32, the DeltaNet mixer where the device puts it (the host).
fn mlx() -> MlxBackend {
    MlxBackend::new(MlxDevice::Cpu, Dtype::F32).unwrap()
}

/// The backends a golden runs on: Qwen 3.5's with the DeltaNet mixer on the host and as
/// MLX ops (the GPU's form, here on the CPU device).
fn backends(variant: &str) -> Vec<MlxBackend> {
    if HYBRIDS.contains(&variant) {
        [DeltaNetPlace::Host, DeltaNetPlace::Device]
            .map(|p| mlx().with_deltanet(p))
            .to_vec()
    } else {
        vec![mlx()]
    }
}

fn assert_close(variant: &str, what: &str, got: &[f32], want: &[f32]) {
    let (w, scale) = worst(got, want);
    eprintln!("{variant} {what}: max |diff| {w:.2e} (scale {scale:.1})");
    assert!(
        w <= TOLERANCE * scale,
        "{variant} {what}: max |diff| {w} > {TOLERANCE} × {scale}"
    );
}

/// The cases of a golden (Qwen 3.5's include one of 150 tokens: three DeltaNet chunks).
fn cases(g: &TextGolden) -> Vec<&'static str> {
    let mut c = vec!["len1", "len7", "len40", "pair_a", "pair_b"];
    if g.reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["name"] == "len150")
    {
        c.push("len150");
    }
    c
}

#[test]
fn logits_match_transformers_and_the_cpu_in_one_pass_and_in_chunks() {
    for variant in HYBRIDS.into_iter().chain(GEMMAS) {
        for be in backends(variant) {
            let g = TextGolden::open(variant);
            let name = &format!("{variant} ({:?})", be.deltanet());
            let m = g.decoder(be);
            let cpu = g.decoder(CandleBackend::cpu());
            for case in cases(&g) {
                let ids = g.case_ids(case);
                let got = forward_all(&m, &ids, &[ids.len()]);
                assert_close(name, case, &got, &g.expected(case));
                let on_cpu = forward_all(&cpu, &ids, &[ids.len()]);
                assert_close(name, &format!("{case} against the cpu"), &got, &on_cpu);
            }
            // Uneven pieces, then single tokens: DeltaNet chunks straddled, sliding windows
            // dropping keys that KV-shared layers still read within a piece.
            let (case, chunks) = if g.reference["cases"].to_string().contains("len150") {
                ("len150", &[70, 1, 5, 64, 1, 1, 10][..])
            } else {
                ("len40", &[5, 3, 9, 1, 1, 1, 20][..])
            };
            let ids = g.case_ids(case);
            assert_close(
                name,
                &format!("{case} in pieces {chunks:?}"),
                &forward_all(&m, &ids, chunks),
                &g.expected(case),
            );
        }
    }
}

/// The dense families that need MLX's optional ops: rotary that scales its cosines and
/// sines (Mistral's YaRN, Phi-3's LongRoPE over half of each head), LayerNorm with biases
/// and an ungated GELU MLP (StarCoder 2). Every position in one pass, and in uneven pieces
/// then single tokens (Mistral's sliding window of 8 dropping keys), against transformers.
#[test]
fn dense_families_of_optional_ops_match_transformers() {
    for variant in ["mistral", "phi3", "starcoder2"] {
        let g = TextGolden::open(variant);
        let m = g.decoder(mlx());
        for case in ["len1", "len7", "len40", "pair_a", "pair_b"] {
            let ids = g.case_ids(case);
            let got = forward_all(&m, &ids, &[ids.len()]);
            assert_close(variant, case, &got, &g.expected(case));
        }
        let ids = g.case_ids("len40");
        let chunks = [5, 3, 9, 1, 1, 1, 20];
        let got = forward_all(&m, &ids, &chunks);
        assert_close(variant, "len40 in pieces", &got, &g.expected("len40"));
    }
}

/// PEFT's all-linear adapters of both families (DeltaNet projections, the gated q_proj,
/// per-layer-input projections, the router): every position, in one pass and in pieces,
/// and rows on different adapters and on the base model in one batch, against PEFT.
#[test]
fn adapters_match_peft() {
    let g = HybridAdapters::open();
    let ids = g.ids();
    for model in MODELS {
        for be in backends(model) {
            let m = TextGolden::open(model).decoder(be);
            let (a, b) = (upload(&m, model, "a"), upload(&m, model, "b"));
            for (sel, w) in [("a", &a), ("b", &b)] {
                let want = g.expected(model, sel);
                let one = all_with(&m, &ids, &[ids.len()], &[w]);
                assert_close(model, &format!("adapter {sel}"), &one, &want);
                let pieces = all_with(&m, &ids, &[4, 1, 1, 6], &[w]);
                assert_close(model, &format!("adapter {sel} in pieces"), &pieces, &want);
            }
            let got = mixed_batch(&m, &ids, 9, &[vec![&a], Vec::new(), vec![&b]]);
            for (sel, got) in ["a", "none", "b"].iter().zip(&got) {
                let what = format!("adapter {sel} in a mixed batch");
                assert_close(model, &what, got, &g.expected(model, sel));
            }
        }
    }
}

/// Adapters on the tiny Gemma 4 MoE's stacked experts (PEFT's `target_parameters`; the
/// experts routed on the host, one product per expert): every position, in one pass, in
/// pieces and in a mixed batch, against PEFT.
#[test]
fn expert_adapters_match_peft() {
    let g = ExpertAdapters::open();
    let m = TextGolden::open(ExpertAdapters::MODEL).decoder(mlx());
    g.check(&m, TOLERANCE);
}

#[test]
fn batched_sequences_match_single_runs() {
    for variant in HYBRIDS.into_iter().chain(GEMMAS) {
        for be in backends(variant) {
            let g = TextGolden::open(variant);
            let m = g.decoder(be);
            let vocab = m.config().vocab_size;
            let (a, b) = (g.case_ids("pair_a"), g.case_ids("pair_b"));
            let (mut ca, mut cb) = (m.new_cache(), m.new_cache());
            let out = forward_batch(
                &m,
                vec![
                    (&a, &mut ca, LogitsRequest::All),
                    (&b, &mut cb, LogitsRequest::All),
                ],
            );
            assert_close(variant, "pair_a batched", &out[0], &g.expected("pair_a"));
            assert_close(variant, "pair_b batched", &out[1], &g.expected("pair_b"));
            // One decode step of both (each fed its first token again) equals each alone.
            let step = forward_batch(
                &m,
                vec![
                    (&a[..1], &mut ca, LogitsRequest::Last),
                    (&b[..1], &mut cb, LogitsRequest::Last),
                ],
            );
            for (seq, got) in [(&a, &step[0]), (&b, &step[1])] {
                let mut ids = seq.clone();
                ids.push(seq[0]);
                let alone = pass(&m, &ids, &mut m.new_cache(), LogitsRequest::Last).unwrap();
                assert_close(variant, "batched decode step", got, &alone.data);
            }
            assert_eq!(out[1].len(), b.len() * vocab);
        }
    }
}

/// `steps` greedy tokens after each of `prompts`, the argmax on the backend, all prompts
/// in one batch.
fn greedy_batched(m: &Decoder<MlxBackend>, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<u32>> {
    let mut caches: Vec<_> = prompts.iter().map(|_| m.new_cache()).collect();
    let mut next = prompts.to_vec();
    let mut all = vec![Vec::new(); prompts.len()];
    for _ in 0..steps {
        let mut items: Vec<BatchItem<'_, MlxBackend>> = caches
            .iter_mut()
            .zip(&next)
            .map(|(c, t)| BatchItem::new(t, c, Want::Token))
            .collect();
        let ids = m.execute(&mut items, None).unwrap();
        for ((out, t), id) in all.iter_mut().zip(next.iter_mut()).zip(ids) {
            let RowOutput::Token(id) = id else {
                panic!("no token: {id:?}")
            };
            out.push(id);
            *t = vec![id];
        }
    }
    all
}

#[test]
fn greedy_tokens_equal_the_cpu_and_generate() {
    const STEPS: usize = 12;
    for variant in HYBRIDS.into_iter().chain(GEMMAS) {
        for be in backends(variant) {
            let g = CpuGolden::load(variant);
            let m = g.golden.decoder(be);
            let (prompt, generate) = g.greedy();
            let prompts = [g.case_ids("len7"), g.case_ids("len40"), prompt];
            let batched = greedy_batched(&m, &prompts, STEPS);
            for (i, p) in prompts.iter().enumerate() {
                let want = greedy_decode(&g.model, p, STEPS);
                assert_eq!(
                    greedy_decode(&m, p, STEPS),
                    want,
                    "{variant} prompt {i} alone"
                );
                assert_eq!(batched[i], want, "{variant} prompt {i} batched");
            }
            let n = generate.len().min(STEPS);
            assert_eq!(
                batched[2][..n],
                generate[..n],
                "{variant}: transformers' greedy continuation"
            );
        }
    }
}

/// Gemma 4's chat golden: scripted weights make greedy decoding write a reasoning channel
/// and a tool call token by token, as transformers' `generate` does.
#[test]
fn gemma4_chat_script_decodes_as_generate() {
    let dir = golden_dir("gemma4_chat");
    let reference = read_json(&dir.join("reference.json"));
    let m = decoder_from_dir(mlx(), &dir);
    let (prompt, script) = (
        ids_of(&reference["prompt_ids"]),
        ids_of(&reference["scripted_ids"]),
    );
    assert_eq!(greedy_decode(&m, &prompt, script.len()), script);
}

/// Gemma 4's audio Conformer runs on the host and its rows enter the MLX pass where the
/// clip's soft tokens stand: every position with a clip (in one pass and in chunks that
/// cut no clip) and without, and `generate()`'s greedy continuation, as transformers.
#[test]
fn gemma4_audio_rows_enter_the_pass_as_transformers_places_them() {
    let options = LoadOptions {
        backend: BackendKind::Mlx,
        ..LoadOptions::default()
    };
    let g = MediaGolden::open_with("gemma4_audio", audio_media, &options);
    assert!(g.model.info().media.audio.is_some());
    g.chunked_matches(&["mono", "text_only"], &[usize::MAX, 7]);
    g.greedy_continuation_matches_generate("mono");
}

/// The vision towers on MLX — Gemma 3's SigLIP (LayerNorms, a GELU MLP, an image's patches
/// attending both ways), Gemma 4's encoder (`attention_to`), the Qwen-VL towers of Qwen 3.5
/// and Qwen2.5-VL (2-D rotary from host tables) — their soft tokens placed in the prompt,
/// with Gemma 4's image blocks seeing each other both ways where the configuration says so
/// (`gemma4_vision_bidir`) and Qwen's text rotating with M-RoPE positions: transformers'
/// logits in one pass and in chunks moved off the images, and `generate()`'s greedy
/// continuation.
#[test]
fn images_enter_the_pass_as_transformers_places_them() {
    let options = LoadOptions {
        backend: BackendKind::Mlx,
        ..LoadOptions::default()
    };
    let goldens: [(&str, MediaOf); 5] = [
        ("gemma3_vision", gemma3_media),
        ("gemma4_vision", gemma4_media),
        ("gemma4_vision_bidir", gemma4_media),
        ("qwen35_vision", qwen_media),
        ("qwen25_vl", qwen_media),
    ];
    for (variant, media_of) in goldens {
        let g = MediaGolden::open_with(variant, media_of, &options);
        assert!(g.model.info().media.vision.is_some(), "{variant}");
        let mut cases = vec!["one_image", "two_images", "text_only"];
        if variant.starts_with("qwen") {
            // M-RoPE positions after images, and turns after an image.
            cases.extend(["text_then_images", "image_then_turns"]);
        }
        g.chunked_matches(&cases, &[usize::MAX, 5]);
        g.greedy_continuation_matches_generate("one_image");
    }
}

/// A DeltaNet state after 100 tokens, rebuilt from its host copy (the prompt cache's SSD
/// and host tiers) or cloned from the live cache (the prompt cache's entries), continues as
/// the live one does; the live cache is not changed by its clone's continuation.
#[test]
fn qwen35_states_restored_and_cloned_continue_like_the_original() {
    for variant in HYBRIDS {
        for be in backends(variant) {
            let g = TextGolden::open(variant);
            let m = g.decoder(be);
            let vocab = m.config().vocab_size;
            let long = g.case_ids("len150");
            let want = g.expected("len150");
            let (head, tail) = long.split_at(100);
            let mut cache = m.new_cache();
            pass(&m, head, &mut cache, LogitsRequest::None);
            assert!(cache.can_trim_to(100) && !cache.can_trim_to(99));
            let kv = cache.snapshot();
            let rec = cache.recurrent().unwrap().snapshot();
            assert!(rec
                .layers
                .iter()
                .all(|(_, ssm)| ssm.iter().any(|&x| x != 0.0)));
            let mut restored = m.cache_from_snapshots(&kv, Some(&rec)).unwrap();
            let mut shared = cache.clone();
            let want_tail = &want[100 * vocab..];
            let on_clone = pass(&m, tail, &mut shared, LogitsRequest::All)
                .unwrap()
                .data;
            assert_close(variant, "len150 on a clone after 100", &on_clone, want_tail);
            assert_eq!(
                cache.recurrent().unwrap().snapshot(),
                rec,
                "{variant}: writing a clone changed the original's states"
            );
            let live = pass(&m, tail, &mut cache, LogitsRequest::All).unwrap().data;
            assert_eq!(live, on_clone);
            let again = pass(&m, tail, &mut restored, LogitsRequest::All)
                .unwrap()
                .data;
            assert_close(variant, "len150 rebuilt from the host", &again, want_tail);
            // The CPU backend reads MLX's host copies and continues the same way.
            let cpu = g.decoder(CandleBackend::cpu());
            let mut on_cpu = cpu.cache_from_snapshots(&kv, Some(&rec)).unwrap();
            let cont = pass(&cpu, tail, &mut on_cpu, LogitsRequest::All)
                .unwrap()
                .data;
            assert_close(variant, "len150 continued on the cpu", &cont, want_tail);
        }
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

/// The mixer at the real models' head sizes, in both of MLX's forms, (128 key and value dimensions, two value heads
/// per key head) gives the host's: decode rows, short rows, one chunk exactly and prompts
/// of several chunks with a partial last one, side by side in batches whose states carry
/// from pass to pass.
#[test]
fn deltanet_mixer_of_real_head_sizes_matches_the_host() {
    let shape = DeltaShape {
        k_heads: 2,
        v_heads: 4,
        k_dim: 128,
        v_dim: 128,
        conv_kernel: 4,
    };
    let cd = shape.conv_dim();
    let conv: Vec<f32> = noise(cd * shape.conv_kernel, 1)
        .iter()
        .map(|w| w * 0.5)
        .collect();
    // Decays per token between about 0.1 and 0.998: in the slow heads what earlier chunks
    // left in the state still counts 64 tokens on.
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
    let (want, want_states) = mix_passes(&CandleBackend::cpu(), &p, &passes);
    for be in backends("qwen35") {
        let (got, got_states) = mix_passes(&be, &p, &passes);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close("DeltaNet 128", &format!("pass {i} {:?}", passes[i]), g, w);
        }
        for (i, (g, w)) in got_states.iter().zip(&want_states).enumerate() {
            let what = format!("sequence {i}'s convolution state");
            assert_close("DeltaNet 128", &what, &g.conv, &w.conv);
            let what = format!("sequence {i}'s delta-rule state");
            assert_close("DeltaNet 128", &what, &g.ssm, &w.ssm);
        }
    }
}
