//! wick against mlx-lm, its oracle: every prompt position's logits and 24 greedy tokens,
//! on the reference set scripts/gpu/make_cpu_reference.sh writes to
//! `$WICK_HOME/mlx-reference` (real SmolLM2 weights in bf16, MLX 4-bit and mixed 4/6-bit
//! checkpoints with per-layer overrides, a random Qwen2-shaped model in f32 and 8-bit).
//! The MLX backend runs the same MLX kernels as mlx-lm, so it must agree closely and
//! greedily token for token; the candle backend (f32, MLX checkpoints dequantized on the
//! host) must agree within bf16 rounding. Needs `--features mlx`.
#![cfg(feature = "mlx")]
use std::path::{Path, PathBuf};

use wick_engine::backend::BackendKind;
use wick_engine::weights::SafetensorsWeights;
use wick_engine::{LoadOptions, LogitsRequest, Model};

mod common;
use common::golden::{floats, ids_of, read_json};
use common::logits::{argmax, model_pass};
use common::serving::wick_home;

fn reference_dir() -> PathBuf {
    wick_home().join("mlx-reference")
}

struct Reference {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    logits: Vec<f32>,
    vocab: usize,
}

fn reference(model: &Path) -> Reference {
    let json = model.join("mlx_lm_reference.json");
    assert!(
        json.is_file(),
        "{} is missing: run scripts/gpu/make_cpu_reference.sh (see docs/mlx.md)",
        json.display()
    );
    let info = read_json(&json);
    let ids = |k: &str| ids_of(&info[k]);
    let st = SafetensorsWeights::open_files(model, &[model.join("mlx_lm_reference.safetensors")])
        .unwrap();
    Reference {
        prompt: ids("prompt_ids"),
        greedy: ids("greedy"),
        vocab: st.raw("logits").unwrap().shape[1],
        logits: floats(&st, "logits"),
    }
}

fn all_logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    model_pass(model, prompt, &mut model.new_cache(), LogitsRequest::All)
        .unwrap()
        .data
}

/// `(‖a − b‖ / ‖b‖, max |a − b| / max |b|)`.
fn distance(a: &[f32], b: &[f32]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let (mut d2, mut n2, mut dmax, mut bmax) = (0f64, 0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = (x - y) as f64;
        d2 += d * d;
        n2 += (y as f64).powi(2);
        dmax = dmax.max(d.abs());
        bmax = bmax.max((y as f64).abs());
    }
    ((d2 / n2).sqrt(), dmax / bmax)
}

fn load(dir: &Path, backend: BackendKind) -> Model {
    Model::load(
        dir,
        &LoadOptions {
            backend,
            ..LoadOptions::default()
        },
    )
    .unwrap()
}

/// Teacher-forced greedy check: at each step of mlx-lm's greedy continuation, our argmax
/// equals mlx-lm's token, or mlx-lm's token is within `near_tie` (relative to the row's
/// largest |logit|) of our best — a near-tie another summation order may flip. Returns
/// (exact steps, near-tie steps).
fn teacher_forced(model: &Model, r: &Reference, near_tie: f32) -> (usize, usize) {
    let mut all = r.prompt.clone();
    all.extend_from_slice(&r.greedy[..r.greedy.len() - 1]);
    let logits = all_logits(model, &all);
    let (mut exact, mut ties) = (0, 0);
    for (i, &want) in r.greedy.iter().enumerate() {
        let row = &logits[(r.prompt.len() - 1 + i) * r.vocab..(r.prompt.len() + i) * r.vocab];
        let best = argmax(row);
        if best == want {
            exact += 1;
            continue;
        }
        let scale = row.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let gap = (row[best as usize] - row[want as usize]) / scale;
        assert!(
            gap < near_tie,
            "greedy step {i}: we pick {best}, mlx-lm {want}, with a clear margin {gap:.2e}"
        );
        ties += 1;
    }
    (exact, ties)
}

fn free_running(model: &Model, r: &Reference) -> usize {
    let run = model
        .generate_greedy(std::slice::from_ref(&r.prompt), r.greedy.len(), 512)
        .unwrap();
    run.tokens[0]
        .iter()
        .zip(&r.greedy)
        .take_while(|(a, b)| a == b)
        .count()
}

/// Compares the MLX backend (and candle, when `candle_tol` is given) with mlx-lm.
fn check(dir: &Path, mlx_tol: f64, candle_tol: Option<f64>, near_tie: f32) {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let r = reference(dir);
    let n = r.prompt.len();
    assert_eq!(r.logits.len(), n * r.vocab);
    let steps = r.greedy.len();

    let mlx = load(dir, BackendKind::Mlx);
    let (rel, max) = distance(&all_logits(&mlx, &r.prompt), &r.logits);
    eprintln!("{name}: mlx vs mlx-lm: prompt logits rel {rel:.2e} (max {max:.2e})");
    let (exact, ties) = teacher_forced(&mlx, &r, near_tie);
    let same = free_running(&mlx, &r);
    eprintln!(
        "{name}: mlx vs mlx-lm: logits rel {rel:.2e} (max {max:.2e}), teacher-forced greedy \
         {exact}/{steps} (+{ties} near-ties), free-running {same}/{steps}"
    );
    assert!(
        rel < mlx_tol,
        "{name}: MLX logits {rel:.2e} from mlx-lm's (tolerance {mlx_tol:.0e})"
    );
    drop(mlx);
    if let Some(candle_tol) = candle_tol {
        let candle = load(dir, BackendKind::Candle);
        let (crel, cmax) = distance(&all_logits(&candle, &r.prompt), &r.logits);
        let (cexact, cties) = teacher_forced(&candle, &r, near_tie);
        let csame = free_running(&candle, &r);
        eprintln!(
            "{name}: candle vs mlx-lm: logits rel {crel:.2e} (max {cmax:.2e}), teacher-forced \
             greedy {cexact}/{steps} (+{cties} near-ties), free-running {csame}/{steps}"
        );
        assert!(
            crel < candle_tol,
            "{name}: candle logits {crel:.2e} from mlx-lm's (tolerance {candle_tol:.0e})"
        );
    }
}

fn cpu_set(name: &str, mlx_tol: f64, candle_tol: f64) {
    check(&reference_dir().join(name), mlx_tol, Some(candle_tol), 1e-2);
}

#[test]
fn smollm2_bf16_matches_mlx_lm() {
    cpu_set("smollm2-135m-bf16", 1e-2, 3e-2);
}

#[test]
fn smollm2_4bit_matches_mlx_lm() {
    cpu_set("smollm2-135m-4bit", 1e-2, 3e-2);
}

#[test]
fn smollm2_mixed_overrides_match_mlx_lm() {
    cpu_set("smollm2-135m-mixed", 1e-2, 3e-2);
}

#[test]
fn qwen2_f32_matches_mlx_lm() {
    cpu_set("tiny-qwen2-f32", 1e-4, 1e-3);
}

#[test]
fn qwen2_8bit_matches_mlx_lm() {
    cpu_set("tiny-qwen2-8bit", 1e-4, 1e-3);
}

/// The models named in `WICK_MLX_REFERENCE_MODELS` (space separated, under
/// `$WICK_HOME/mlx-reference`): the GPU check scripts/gpu/check.sh runs on the H200 with
/// references mlx-lm made there. bf16 tolerances; candle only below 2B parameters.
#[test]
#[ignore = "needs WICK_MLX_REFERENCE_MODELS and their references (scripts/gpu/check.sh)"]
fn listed_models_match_mlx_lm() {
    let list = std::env::var("WICK_MLX_REFERENCE_MODELS")
        .expect("WICK_MLX_REFERENCE_MODELS names the models to check");
    let names: Vec<&str> = list.split_whitespace().collect();
    assert!(!names.is_empty(), "WICK_MLX_REFERENCE_MODELS is empty");
    for name in names {
        let dir = reference_dir().join(name);
        let bytes: u64 = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
            .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
            .sum();
        let small = bytes < 4 << 30;
        check(&dir, 2e-2, small.then_some(5e-2), 2e-2);
    }
}
