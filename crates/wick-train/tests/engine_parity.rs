//! The training forward against the engine's forward on the same weights (the tiny random
//! Llamas of `wick-engine/tests/goldens/hf`): logits within 1e-4, without an adapter and
//! with non-zero factors saved in the PEFT layout and mounted by the engine; and the
//! hand-written backward against central finite differences of the loss (also under
//! LoRA dropout, and recomputed under gradient checkpointing); the mlx-lm half of a saved
//! adapter mounts to the same logits as the PEFT half. Qwen 3.5 (gated DeltaNet layers,
//! the attention output gate inside `q_proj`) is covered alike.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use wick_engine::adapters::{AdapterRegistry, Target};
use wick_engine::{LoadOptions, Model, RowOutput, StepPlan, StepRow, Want};
use wick_train::adapter_io::save_adapter;
use wick_train::base::BaseWeights;
use wick_train::decoder::{AdapterRef, Batch, Dropout, TrainDecoder};
use wick_train::lora::{LoraConfig, LoraParams, TRAINED};

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../wick-engine/tests/goldens/hf")
        .join(name)
}

const TOKENS: [u32; 11] = [1, 17, 250, 3, 99, 411, 7, 7, 128, 500, 64];

fn random_factors(base: &BaseWeights, lora: &LoraConfig, seed: u64) -> LoraParams {
    let mut p = LoraParams::init(&base.cfg, lora, seed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed + 1);
    for pair in p.pairs_mut() {
        for v in &mut pair.b {
            *v = rng.random_range(-0.2..0.2);
        }
    }
    p
}

fn engine_logits(model: &Model, tokens: &[u32], adapter: Option<&Path>) -> Vec<f32> {
    let mut cache = model.new_cache();
    let registry = AdapterRegistry::default();
    let stack = adapter.map(|path| {
        registry
            .insert(Arc::new(model.load_adapter("t", path).unwrap()))
            .unwrap();
        registry.resolve(Some("t")).unwrap()
    });
    let plan = StepPlan::new(vec![StepRow {
        tokens,
        cache: &mut cache,
        want: Want::AllLogits,
        adapters: stack.as_ref(),
    }]);
    match model.execute(plan).unwrap().remove(0) {
        RowOutput::Logits(l) => l.data,
        other => panic!("no logits: {other:?}"),
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-4 * scale,
        "{what}: max |diff| {worst} (scale {scale})"
    );
}

#[test]
fn training_logits_match_the_engine() {
    for name in [
        "llama",
        "llama_tied",
        "starcoder2",
        "phi3",
        "glm4",
        "gemma4",
        "qwen35",
        "qwen35_tied",
    ] {
        let dir = golden(name);
        let base = BaseWeights::load(&dir).unwrap();
        let model = Model::load(&dir, &LoadOptions::default()).unwrap();
        let dec = TrainDecoder::new(&base, 64);
        let mut batch = Batch::new();
        batch.push(&TOKENS, &[]);
        let got = dec.logits(None, &batch).unwrap();
        assert_close(name, &got, &engine_logits(&model, &TOKENS, None));

        // Non-zero factors on every projection (Qwen 3.5's DeltaNet ones too), written as
        // PEFT and mounted by the engine.
        let lora = LoraConfig {
            rank: 4,
            scale: 2.0,
            targets: TRAINED.to_vec(),
            ..LoraConfig::default()
        };
        let params = random_factors(&base, &lora, 7);
        let tmp = tempfile::tempdir().unwrap();
        save_adapter(tmp.path(), &params, &lora, base.cfg.num_layers, name).unwrap();
        let adapter = AdapterRef::new(&params, lora.multiplier());
        let got = dec.logits(Some(adapter), &batch).unwrap();
        let want = engine_logits(&model, &TOKENS, Some(tmp.path()));
        assert_close(&format!("{name} + adapter"), &got, &want);
        // The mlx-lm weights beside them (lora_a [in, r], lora_b [r, out], the absolute
        // scale in lora_parameters) mount to the same logits on their own.
        let mlx = tempfile::tempdir().unwrap();
        for f in ["adapters.safetensors", "adapter_config.json"] {
            std::fs::copy(tmp.path().join(f), mlx.path().join(f)).unwrap();
        }
        let from_mlx = engine_logits(&model, &TOKENS, Some(mlx.path()));
        assert_close(&format!("{name} + mlx-lm adapter"), &from_mlx, &want);
        let base_only = engine_logits(&model, &TOKENS, None);
        let moved = want
            .iter()
            .zip(&base_only)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(moved > 1e-2, "the adapter moves the logits by only {moved}");
    }
}

/// Packed sequences attend only to themselves and (Qwen 3.5's DeltaNet layers) each
/// starts from a zero state.
#[test]
fn packed_sequences_do_not_see_each_other() {
    for name in ["llama", "qwen35"] {
        let base = BaseWeights::load(&golden(name)).unwrap();
        let dec = TrainDecoder::new(&base, 64);
        let (a, b) = (&TOKENS[..6], &TOKENS[4..]);
        let one = |t: &[u32]| {
            let mut batch = Batch::new();
            batch.push(t, &[]);
            dec.logits(None, &batch).unwrap()
        };
        let mut both = Batch::new();
        both.push(a, &[]);
        both.push(b, &[]);
        let packed = dec.logits(None, &both).unwrap();
        let mut want = one(a);
        want.extend(one(b));
        assert_close(&format!("{name} packed"), &packed, &want);
    }
}

/// Σ over targets of −log p, as f64, for finite differences.
fn loss(dec: &TrainDecoder<'_>, a: AdapterRef<'_>, batch: &Batch) -> f64 {
    -dec.logp(Some(a), batch)
        .unwrap()
        .iter()
        .map(|&v| f64::from(v))
        .sum::<f64>()
}

fn fd_batch() -> Batch {
    let mut batch = Batch::new();
    let labeled: Vec<bool> = (0..TOKENS.len()).map(|t| t >= 4).collect();
    batch.push(&TOKENS, &labeled);
    batch.push(&TOKENS[2..9], &[true; 7]);
    batch
}

/// The analytic gradient of [`loss`] under `dropout`.
fn grads_of(
    dec: &TrainDecoder<'_>,
    params: &LoraParams,
    mult: f32,
    dropout: Option<Dropout>,
    batch: &Batch,
) -> LoraParams {
    let a = AdapterRef::new(params, mult).with_dropout(dropout);
    let fwd = dec.forward(Some(a), batch).unwrap();
    let dlogp = vec![-1.0f32; fwd.logp.len()];
    let mut grads = params.zeros_like();
    dec.backward(a, batch, fwd, &dlogp, &mut grads).unwrap();
    grads
}

/// A few entries of A and B of every target against central differences.
fn check_against_finite_differences(
    dec: &TrainDecoder<'_>,
    params: &LoraParams,
    mult: f32,
    dropout: Option<Dropout>,
    grads: &LoraParams,
    batch: &Batch,
) {
    let mut checked = 0;
    for (l, t, g) in grads.iter() {
        for (factor, idx) in [("a", 0usize), ("a", 5), ("b", 1), ("b", 3)] {
            let eps = 1e-2f32;
            let bump = |d: f32| {
                let mut p = params.clone();
                let pair = p.layers[l][t.index()].as_mut().unwrap();
                let v = if factor == "a" {
                    &mut pair.a
                } else {
                    &mut pair.b
                };
                v[idx] += d;
                loss(dec, AdapterRef::new(&p, mult).with_dropout(dropout), batch)
            };
            let numeric = (bump(eps) - bump(-eps)) / (2.0 * f64::from(eps));
            let analytic = f64::from(if factor == "a" { g.a[idx] } else { g.b[idx] });
            // The loss is an f32 sum of ~60: differences carry ~2e-4 of rounding.
            let tol = 2e-3 * numeric.abs().max(analytic.abs()) + 5e-4;
            assert!(
                (numeric - analytic).abs() <= tol,
                "layer {l} {t:?} {factor}[{idx}]: numeric {numeric} analytic {analytic}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, grads.iter().count() * 4);
}

#[test]
fn backward_matches_finite_differences() {
    let base = BaseWeights::load(&golden("llama")).unwrap();
    let dec = TrainDecoder::new(&base, 64);
    let lora = LoraConfig {
        rank: 2,
        scale: 1.5,
        ..LoraConfig::default()
    };
    let params = random_factors(&base, &lora, 3);
    let batch = fd_batch();
    let mult = lora.multiplier();
    let grads = grads_of(&dec, &params, mult, None, &batch);
    check_against_finite_differences(&dec, &params, mult, None, &grads, &batch);
}

/// Qwen 3.5 over two packed sequences, every linear layer adapted: the DeltaNet layers'
/// backward (through their projections' factors and the layers above) and the attention
/// layer's output gate, each sequence from its own state.
#[test]
fn qwen35_backward_matches_finite_differences() {
    let base = BaseWeights::load(&golden("qwen35")).unwrap();
    let dec = TrainDecoder::new(&base, 64);
    let lora = LoraConfig {
        rank: 2,
        scale: 1.5,
        targets: TRAINED.to_vec(),
        ..LoraConfig::default()
    };
    let params = random_factors(&base, &lora, 3);
    assert!(params.iter().any(|(_, t, _)| t == Target::DeltaQkv));
    let batch = fd_batch();
    let mult = lora.multiplier();
    let grads = grads_of(&dec, &params, mult, None, &batch);
    check_against_finite_differences(&dec, &params, mult, None, &grads, &batch);
}

#[test]
fn dropout_keeps_the_gradient_exact() {
    let base = BaseWeights::load(&golden("llama")).unwrap();
    let dec = TrainDecoder::new(&base, 64);
    let lora = LoraConfig {
        rank: 2,
        scale: 1.5,
        ..LoraConfig::default()
    };
    let params = random_factors(&base, &lora, 5);
    let batch = fd_batch();
    let mult = lora.multiplier();
    let dropout = Dropout::new(0.3, 11, 4, 1);
    let grads = grads_of(&dec, &params, mult, dropout, &batch);
    // The mask is part of the function: finite differences through the same mask.
    check_against_finite_differences(&dec, &params, mult, dropout, &grads, &batch);
    // It changes the gradient (the branch sees dropped inputs) ...
    let plain = grads_of(&dec, &params, mult, None, &batch);
    assert_ne!(plain, grads);
    // ... and the backward draws the same masks as the forward: the same numbers to the
    // bit on a second run.
    assert_eq!(grads_of(&dec, &params, mult, dropout, &batch), grads);
}

/// Gradient checkpointing runs each layer again in the backward from its saved input:
/// the same ops on the same values, so the same gradients to the bit — with dropout (the
/// recomputed layer draws the same masks), on families whose layers carry Q/K norms,
/// sandwich norms and soft caps, on Qwen 3.5 (each DeltaNet layer run again from a zero
/// state, its projections adapted too), and when only the top layers are adapted (the
/// layers below are run once and never again).
#[test]
fn checkpointing_gives_the_same_gradients() {
    for (name, num_layers) in [
        ("llama", None),
        ("llama", Some(1)),
        ("gemma2", None),
        ("qwen35", None),
        ("qwen35", Some(2)),
    ] {
        let base = BaseWeights::load(&golden(name)).unwrap();
        let plain = TrainDecoder::new(&base, 64);
        let ckpt = TrainDecoder::new(&base, 64).with_checkpointing(true);
        let lora = LoraConfig {
            rank: 2,
            scale: 1.5,
            num_layers,
            targets: TRAINED.to_vec(),
            ..LoraConfig::default()
        };
        let params = random_factors(&base, &lora, 7);
        let batch = fd_batch();
        let mult = lora.multiplier();
        let backend = base.decoder.backend();
        for dropout in [None, Dropout::new(0.3, 11, 4, 1)] {
            backend.take_peak_ops();
            let want = grads_of(&plain, &params, mult, dropout, &batch);
            let whole = backend.take_peak_ops();
            let got = grads_of(&ckpt, &params, mult, dropout, &batch);
            let one_layer = backend.take_peak_ops();
            // Each layer is recorded alone: never the whole adapted stack's tape at once.
            assert!(
                one_layer > 0 && one_layer < whole,
                "{name}: {one_layer} ops held at once with checkpointing, {whole} without"
            );
            assert!(
                want.iter().all(|(_, _, g)| g.a.iter().any(|&v| v != 0.0)),
                "{name}: a factor got no gradient"
            );
            assert_eq!(
                got, want,
                "{name} layers {num_layers:?} dropout {dropout:?}"
            );
        }
    }
}

/// Gemma 4 checkpointed: each layer run again alone, the KV-shared layers reading the
/// saved keys and values of the layer below that made them, whose gradients reach that
/// layer's factors when it is run again; the per-layer inputs computed once. The same
/// gradients as the plain backward (summed in another order where keys are the values:
/// within 1e-6), with and without the experts, and with only the top layers adapted.
#[test]
fn gemma4_checkpointing_gives_the_same_gradients() {
    for (name, num_layers) in [("gemma4", None), ("gemma4", Some(2)), ("gemma4_moe", None)] {
        let base = BaseWeights::load(&golden(name)).unwrap();
        assert!(base.decoder.kv_slots().is_some());
        let plain = TrainDecoder::new(&base, 64);
        let ckpt = TrainDecoder::new(&base, 64).with_checkpointing(true);
        let lora = LoraConfig {
            rank: 2,
            scale: 1.5,
            num_layers,
            ..LoraConfig::default()
        };
        let params = random_factors(&base, &lora, 7);
        let batch = fd_batch();
        let mult = lora.multiplier();
        let backend = base.decoder.backend();
        for dropout in [None, Dropout::new(0.3, 11, 4, 1)] {
            backend.take_peak_ops();
            let want = grads_of(&plain, &params, mult, dropout, &batch);
            let whole = backend.take_peak_ops();
            let got = grads_of(&ckpt, &params, mult, dropout, &batch);
            let one_layer = backend.take_peak_ops();
            assert!(
                one_layer > 0 && one_layer < whole,
                "{name}: {one_layer} ops held at once with checkpointing, {whole} without"
            );
            for ((l, t, g), (_, _, w)) in got.iter().zip(want.iter()) {
                for (f, a, b) in [("A", &g.a, &w.a), ("B", &g.b, &w.b)] {
                    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    assert!(scale > 0.0, "{name} layer {l} {t:?} {f}: no gradient");
                    let diff = a
                        .iter()
                        .zip(b)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0.0f32, f32::max);
                    assert!(
                        diff <= 1e-6 * scale,
                        "{name} layers {num_layers:?} dropout {dropout:?} layer {l} {t:?} \
                         {f}: {diff} of {scale}"
                    );
                }
            }
        }
    }
}
