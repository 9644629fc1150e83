//! wick-train against transformers + PEFT + TRL on the tiny random Llama
//! (scripts/goldens/train_parity.py): loss and LoRA gradients of one step of SFT, DPO and
//! ORPO within 1e-4 relative, and the factors after 3 AdamW steps (gradient accumulation,
//! clipping, LoRA+, cosine schedule with warm-up) within 1e-4. The same one-step checks on
//! the tiny Qwen2 (Q/K/V biases), Qwen3 (Q/K norms, head_dim ≠ hidden/heads, tied) and
//! Gemma 2 (soft caps, sliding window, sandwich norms, GELU-tanh, scaled embeddings),
//! Gemma 3, Mistral, OLMo 2, Granite, SmolLM 3, StarCoder 2, Phi-3 and GLM-4 (fused
//! `qkv_proj` / `gate_up_proj`, one pair each) and Gemma 4 (per-layer inputs, KV shared
//! between layers; also the logits after one AdamW step of each objective) and Qwen 3.5
//! (gated DeltaNet layers; the same)
//! (`train_parity.py --family NAME`): families only the engine's decoder trains.
use std::path::{Path, PathBuf};

use serde_json::Value;
use wick_engine::weights::SafetensorsWeights;
use wick_train::adapter_io::load_factors;
use wick_train::base::BaseWeights;
use wick_train::data::{Example, Sequence};
use wick_train::decoder::{AdapterRef, Batch, TrainDecoder};
use wick_train::lora::{parse_targets, LoraConfig, LoraParams};
use wick_train::loss::Method;
use wick_train::optim::Schedule;
use wick_train::trainer::{TrainConfig, Trainer};

fn goldens() -> PathBuf {
    family_goldens("llama")
}

/// The goldens of `family` (`parity` for the Llama, `parity_<family>` for the others).
fn family_goldens(family: &str) -> PathBuf {
    let dir = if family == "llama" {
        "tests/goldens/parity".to_string()
    } else {
        format!("tests/goldens/parity_{family}")
    };
    Path::new(env!("CARGO_MANIFEST_DIR")).join(dir)
}

/// The tiny random model of `family`.
fn base_dir(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../wick-engine/tests/goldens/hf")
        .join(family)
}

fn reference() -> Value {
    family_reference("llama")
}

fn family_reference(family: &str) -> Value {
    let file = family_goldens(family).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn sft_examples(r: &Value) -> Vec<Example> {
    r["sft"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            Example::Sft(Sequence {
                tokens: ids(&s["tokens"]),
                prompt_len: s["prompt_len"].as_u64().unwrap() as usize,
            })
        })
        .collect()
}

fn pair_examples(r: &Value) -> Vec<Example> {
    r["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let prompt = ids(&p["prompt"]);
            let seq = |k: &str| {
                let mut tokens = prompt.clone();
                tokens.extend(ids(&p[k]));
                Sequence {
                    tokens,
                    prompt_len: prompt.len(),
                }
            };
            Example::Pair {
                chosen: seq("chosen"),
                rejected: seq("rejected"),
            }
        })
        .collect()
}

fn trainer<'a>(base: &'a BaseWeights, r: &Value, method: Method) -> Trainer<'a> {
    family_trainer("llama", base, r, method)
}

fn family_trainer<'a>(
    family: &str,
    base: &'a BaseWeights,
    r: &Value,
    method: Method,
) -> Trainer<'a> {
    let rank = r["rank"].as_u64().unwrap() as usize;
    let alpha = r["alpha"].as_f64().unwrap() as f32;
    let mut cfg = TrainConfig::defaults(method);
    cfg.lora = LoraConfig {
        rank,
        scale: alpha / rank as f32,
        ..LoraConfig::default()
    };
    // The goldens adapt what PEFT's config names: the seven projections, and for Qwen 3.5
    // its DeltaNet projections too.
    if family == "qwen35" {
        cfg.lora.targets = parse_targets("all").unwrap();
    }
    cfg.max_seq = 64;
    let mut t = Trainer::new(base, cfg).unwrap();
    let init = family_goldens(family).join("init.safetensors");
    t.params = load_factors(&init, &t.params, "").unwrap();
    t
}

/// max |got − want| over max |want|, per tensor; every tensor within `tol`.
fn assert_params_close(what: &str, got: &LoraParams, want: &LoraParams, tol: f32) {
    for ((l, t, g), (_, _, w)) in got.iter().zip(want.iter()) {
        for (name, a, b) in [("A", &g.a, &w.a), ("B", &g.b, &w.b)] {
            let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let diff = a
                .iter()
                .zip(b.iter())
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(
                scale > 0.0,
                "{what} layer {l} {t:?} {name}: reference is all zero"
            );
            assert!(
                diff <= tol * scale,
                "{what} layer {l} {t:?} {name}: max diff {diff} vs scale {scale}"
            );
        }
    }
}

fn check_one_step(method: Method, case: &str, examples: Vec<Example>) {
    check_family_step("llama", method, case, examples);
}

fn check_family_step(family: &str, method: Method, case: &str, examples: Vec<Example>) {
    let r = family_reference(family);
    let base = BaseWeights::load(&base_dir(family)).unwrap();
    let t = family_trainer(family, &base, &r, method);
    let micro = vec![examples.iter().collect::<Vec<_>>()];
    let (loss, grads) = t.loss_and_grads(&micro).unwrap();
    let want = r[format!("{case}_loss")].as_f64().unwrap();
    assert!(
        ((loss - want) / want).abs() < 1e-4,
        "{case} loss {loss} vs {want}"
    );
    let file = family_goldens(family).join("reference.safetensors");
    let want = load_factors(&file, &grads, &format!("{case}.")).unwrap();
    assert_params_close(&format!("{family} {case} gradient"), &grads, &want, 1e-4);
}

/// SFT, DPO and ORPO one-step parity on `family`'s tiny model.
fn check_family(family: &str) {
    let r = family_reference(family);
    check_family_step(family, Method::Sft, "sft", sft_examples(&r));
    let beta = r["beta"].as_f64().unwrap() as f32;
    check_family_step(family, Method::Dpo { beta }, "dpo", pair_examples(&r));
    let lambda = r["lambda"].as_f64().unwrap() as f32;
    check_family_step(family, Method::Orpo { lambda }, "orpo", pair_examples(&r));
}

#[test]
fn qwen2_steps_match_trl() {
    check_family("qwen2");
}

#[test]
fn qwen3_steps_match_trl() {
    check_family("qwen3");
}

#[test]
fn gemma2_steps_match_trl() {
    check_family("gemma2");
}

/// Local and global rotary bases, (1 + w) Q/K norms, sliding windows.
#[test]
fn gemma3_steps_match_trl() {
    check_family("gemma3");
}

/// A sliding window on every layer, YaRN (an attention factor on cos/sin).
#[test]
fn mistral_steps_match_trl() {
    check_family("mistral");
}

/// Norms after attention and the MLP only, Q/K norms over all heads at once.
#[test]
fn olmo2_steps_match_trl() {
    check_family("olmo2");
}

/// Embedding, residual and attention multipliers, a logit divisor, Llama 3 rotary scaling.
#[test]
fn granite_steps_match_trl() {
    check_family("granite");
}

/// A layer without rotary embeddings (NoPE).
#[test]
fn smollm3_steps_match_trl() {
    check_family("smollm3");
}

#[test]
fn sft_loss_and_gradients_match_trl() {
    check_one_step(Method::Sft, "sft", sft_examples(&reference()));
}

#[test]
fn dpo_loss_and_gradients_match_trl() {
    let r = reference();
    let beta = r["beta"].as_f64().unwrap() as f32;
    check_one_step(Method::Dpo { beta }, "dpo", pair_examples(&r));
}

#[test]
fn orpo_loss_and_gradients_match_trl() {
    let r = reference();
    let lambda = r["lambda"].as_f64().unwrap() as f32;
    check_one_step(Method::Orpo { lambda }, "orpo", pair_examples(&r));
}

#[test]
fn three_adamw_steps_match_torch() {
    let r = reference();
    let base = BaseWeights::load(&base_dir("llama")).unwrap();
    let mut t = trainer(&base, &r, Method::Sft);
    let s = &r["sft3"];
    let f = |k: &str| s[k].as_f64().unwrap() as f32;
    t.config.lr = f("lr");
    t.config.grad_clip = f("clip");
    t.config.adam.weight_decay = f("weight_decay");
    t.config.adam.lora_plus_ratio = f("lora_plus_ratio");
    t.config.warmup = s["warmup"].as_u64().unwrap() as usize;
    t.config.iters = s["total_steps"].as_u64().unwrap() as usize;
    t.config.schedule = Schedule::Cosine;
    t.opt.config = t.config.adam;
    let examples = sft_examples(&r);
    // Two micro-batches of one sequence each per step, as the golden accumulates them.
    let micro: Vec<Vec<&Example>> = examples.iter().map(|e| vec![e]).collect();
    for (i, norm) in s["grad_norms"].as_array().unwrap().iter().enumerate() {
        let stats = t.train_step(&micro).unwrap();
        let want = norm.as_f64().unwrap() as f32;
        assert!(
            ((stats.grad_norm - want) / want).abs() < 1e-4,
            "step {i}: grad norm {} vs {want}",
            stats.grad_norm
        );
    }
    let file = goldens().join("reference.safetensors");
    let want = load_factors(&file, &t.params, "sft3.").unwrap();
    assert_params_close("after 3 steps", &t.params, &want, 1e-4);
}

/// LayerNorm with biases, an ungated GELU-tanh MLP whose modules PEFT names `c_fc` and
/// `c_proj`, biases on every projection.
#[test]
fn starcoder2_steps_match_trl() {
    check_family("starcoder2");
}

/// Q/K/V and gate/up fused in the checkpoint: PEFT adapts `qkv_proj` and `gate_up_proj`
/// as one pair each, whose A the parts share (its gradient sums theirs); LongRoPE.
#[test]
fn phi3_steps_match_trl() {
    check_family("phi3");
}

/// gate/up fused, separate Q/K/V with biases, sandwich norms, partial rotary.
#[test]
fn glm4_steps_match_trl() {
    check_family("glm4");
}

/// Per-layer input embeddings, the last two layers attending to the keys and values of
/// earlier layers (no K/V projections of their own), a wider head and proportional
/// rotation on full layers, V normed without a weight, a double-wide MLP on the KV-shared
/// layers, layer scalars and a final soft cap.
#[test]
fn gemma4_steps_match_trl() {
    check_family("gemma4");
}

/// The adapter after one AdamW step of each objective gives the logits PyTorch's does.
/// Adam's first step moves each value by `lr·g/(|g| + ε)`, which turns gradient errors on
/// the smallest entries into whole steps: at the golden's rate (1e-4) gradients within the
/// parity above keep the logits within 1e-4 while the step still moves them by 0.1 or more.
#[test]
fn gemma4_updated_adapter_logits_match_torch() {
    check_updated_logits("gemma4");
}

#[test]
fn gemma4_moe_updated_adapter_logits_match_torch() {
    check_updated_logits("gemma4_moe");
}

fn check_updated_logits(family: &str) {
    let r = family_reference(family);
    let base = BaseWeights::load(&base_dir(family)).unwrap();
    let step = &r["step"];
    let mut batch = Batch::new();
    for e in sft_examples(&r) {
        if let Example::Sft(s) = e {
            batch.push(&s.tokens, &[]);
        }
    }
    let file = family_goldens(family).join("reference.safetensors");
    let golden = SafetensorsWeights::open_files(&file, std::slice::from_ref(&file)).unwrap();
    let beta = r["beta"].as_f64().unwrap() as f32;
    let lambda = r["lambda"].as_f64().unwrap() as f32;
    let cases = [
        ("sft", Method::Sft, sft_examples(&r)),
        ("dpo", Method::Dpo { beta }, pair_examples(&r)),
        ("orpo", Method::Orpo { lambda }, pair_examples(&r)),
    ];
    let dec = TrainDecoder::new(&base, 64);
    let init = family_trainer(family, &base, &r, Method::Sft).params;
    let before = dec
        .logits(
            Some(AdapterRef::new(
                &init,
                r["alpha"].as_f64().unwrap() as f32 / init.rank as f32,
            )),
            &batch,
        )
        .unwrap();
    for (case, method, examples) in cases {
        let mut t = family_trainer(family, &base, &r, method);
        t.config.lr = step["lr"].as_f64().unwrap() as f32;
        t.config.adam.weight_decay = step["weight_decay"].as_f64().unwrap() as f32;
        t.config.adam.lora_plus_ratio = 1.0;
        t.config.grad_clip = 0.0;
        t.config.warmup = 0;
        t.config.schedule = Schedule::Constant;
        t.opt.config = t.config.adam;
        t.train_step(&[examples.iter().collect()]).unwrap();
        let adapter = AdapterRef::new(&t.params, t.config.lora.multiplier());
        let got = dec.logits(Some(adapter), &batch).unwrap();
        let want = golden
            .raw(&format!("{case}_step_logits"))
            .unwrap()
            .dequantize()
            .unwrap();
        assert_eq!(got.len(), want.len(), "{case}");
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let moved = want
            .iter()
            .zip(&before)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            moved > 1e-2,
            "{case}: the step moves the logits by only {moved}"
        );
        assert!(
            worst <= 1e-4,
            "{case}: logits after one step off by {worst}"
        );
    }
}

/// Gemma 4's experts beside the dense MLP: the router's logits take the gradient of the
/// routing weights (softmax, top 2 renormalised, per-expert scales), the frozen experts
/// pass theirs to the layer's input; full layers use the key projection as values.
#[test]
fn gemma4_moe_steps_match_trl() {
    check_family("gemma4_moe");
}

/// Qwen 3.5: gated DeltaNet layers (convolution, l2-normed queries and keys, the gated
/// delta rule, the gated RMS norm) around a full-attention layer with an output gate (its
/// rows inside `q_proj`), every linear layer adapted, the DeltaNet projections included.
#[test]
fn qwen35_steps_match_trl() {
    check_family("qwen35");
}

#[test]
fn qwen35_updated_adapter_logits_match_torch() {
    check_updated_logits("qwen35");
}
