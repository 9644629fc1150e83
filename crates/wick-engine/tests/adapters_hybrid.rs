//! LoRA adapters on Qwen 3.5 (DeltaNet projections, the gated q_proj) and Gemma 4 (the
//! per-layer-input projections, the expert router) on the CPU backend against
//! transformers + PEFT (scripts/goldens/peft_adapters.py): every position within the
//! adapter tests' 1e-4, in one pass and in pieces; rows on different adapters and on the
//! base model in one batch each get their own logits; a delta on a projection a layer
//! does not have is refused.
use std::path::Path;

use std::sync::Arc;

use wick_engine::adapters::{load_host, AdapterRegistry, ExpertPart};
use wick_engine::backend::candle::CandleBackend;
use wick_engine::models::decoder::Decoder;
use wick_engine::{LoadOptions, LogitsRequest, Model, RowOutput, StepPlan, StepRow, Want};

mod common;
use common::golden::{golden_dir, goldens, TextGolden};
use common::hybrid_adapters::{
    all_with, assert_near, mixed_batch, upload, ExpertAdapters, HybridAdapters, MODELS, SELECTIONS,
};

const TOLERANCE: f32 = 1e-4;

fn cpu(model: &str) -> Decoder<CandleBackend> {
    TextGolden::open(model).decoder(CandleBackend::cpu())
}

#[test]
fn each_adapter_matches_peft_at_every_position() {
    let g = HybridAdapters::open();
    let ids = g.ids();
    for model in MODELS {
        let m = cpu(model);
        for sel in SELECTIONS {
            let w = (sel != "none").then(|| upload(&m, model, sel));
            let stack: Vec<_> = w.iter().collect();
            let want = g.expected(model, sel);
            let one = all_with(&m, &ids, &[ids.len()], &stack);
            assert_near(&format!("{model} {sel}"), &one, &want, TOLERANCE);
            let pieces = all_with(&m, &ids, &[4, 1, 1, 6], &stack);
            assert_near(
                &format!("{model} {sel} in pieces"),
                &pieces,
                &want,
                TOLERANCE,
            );
        }
    }
}

#[test]
fn the_engine_mounts_them_and_requests_select_them() {
    // Through the engine's model (the server's path): mounted by id, selected per row.
    let g = HybridAdapters::open();
    let ids = g.ids();
    for model in MODELS {
        let m = Model::load(&golden_dir(model), &LoadOptions::default()).unwrap();
        let registry = AdapterRegistry::default();
        for sel in ["a", "b"] {
            let dir = goldens().join("adapters/hybrid").join(model).join(sel);
            registry
                .insert(Arc::new(m.load_adapter(sel, &dir).unwrap()))
                .unwrap();
        }
        let info = registry.get("a").unwrap().info().clone();
        let targeted = g.reference["models"][model]["adapters"]["a"]
            .as_array()
            .unwrap()
            .len();
        assert!(info.mounted_layers >= targeted, "{model}: {info:?}");
        assert_eq!(info.skipped_tensors, 0, "{model}: {info:?}");
        let stacks: Vec<_> = ["b", "none", "a"]
            .iter()
            .map(|s| registry.resolve(Some(s)).unwrap())
            .collect();
        let mut caches: Vec<_> = stacks.iter().map(|_| m.new_cache()).collect();
        let rows = caches
            .iter_mut()
            .zip(&stacks)
            .map(|(cache, stack)| StepRow {
                tokens: &ids,
                cache,
                want: Want::logits(LogitsRequest::All),
                adapters: Some(stack),
            })
            .collect();
        let out = m.execute(StepPlan::new(rows)).unwrap();
        for (sel, o) in ["b", "none", "a"].iter().zip(out) {
            let RowOutput::Logits(l) = o else {
                panic!("{model} {sel}: no logits")
            };
            let what = format!("{model} {sel} through the engine");
            assert_near(&what, &l.data, &g.expected(model, sel), TOLERANCE);
        }
    }
}

#[test]
fn the_adapters_move_the_logits() {
    // The goldens are only worth something if each adapter changes the logits, and if
    // adapter a reaches every projection kind the family adds.
    let g = HybridAdapters::open();
    for model in MODELS {
        let e = &g.reference["models"][model];
        for sel in ["a", "b"] {
            let d = e["max_abs_diff_from_base"][sel].as_f64().unwrap();
            assert!(d > 0.1, "{model} {sel} changes the logits by only {d}");
        }
        let targets: Vec<&str> = e["adapters"]["a"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let must = match model {
            "qwen35" => &[
                "linear_attn.in_proj_qkv",
                "linear_attn.in_proj_z",
                "linear_attn.in_proj_b",
                "linear_attn.in_proj_a",
                "linear_attn.out_proj",
                "self_attn.q_proj",
            ][..],
            "gemma4" => &[
                "per_layer_input_gate",
                "per_layer_projection",
                "per_layer_model_projection",
            ][..],
            _ => &["router.proj"][..],
        };
        for t in must {
            assert!(targets.contains(t), "{model}'s adapter a misses {t}");
        }
    }
}

#[test]
fn rows_on_different_adapters_in_one_batch_get_their_own_logits() {
    let g = HybridAdapters::open();
    let ids = g.ids();
    for model in MODELS {
        let m = cpu(model);
        let (a, b) = (upload(&m, model, "a"), upload(&m, model, "b"));
        let stacks = vec![vec![&a], Vec::new(), vec![&b]];
        let got = mixed_batch(&m, &ids, 9, &stacks);
        for (sel, got) in ["a", "none", "b"].iter().zip(&got) {
            let alone = match *sel {
                "a" => all_with(&m, &ids, &[ids.len()], &[&a]),
                "b" => all_with(&m, &ids, &[ids.len()], &[&b]),
                _ => all_with(&m, &ids, &[ids.len()], &[]),
            };
            assert_near(
                &format!("{model} {sel} batched vs alone"),
                got,
                &alone,
                1e-5,
            );
            assert_near(
                &format!("{model} {sel} batched vs PEFT"),
                got,
                &g.expected(model, sel),
                TOLERANCE,
            );
        }
    }
}

/// A PEFT adapter of one delta, `module` of `layer`, zeros of the given shapes.
fn one_delta(dir: &Path, layer: usize, module: &str, a: [usize; 2], b: [usize; 2]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 4}"#,
    )
    .unwrap();
    let stem = format!("base_model.model.model.layers.{layer}.{module}");
    common::golden::write_safetensors(
        &dir.join("adapter_model.safetensors"),
        vec![
            (
                format!("{stem}.lora_A.weight"),
                "F32".into(),
                a.to_vec(),
                vec![0u8; 4 * a[0] * a[1]],
            ),
            (
                format!("{stem}.lora_B.weight"),
                "F32".into(),
                b.to_vec(),
                vec![0u8; 4 * b[0] * b[1]],
            ),
        ],
    );
}

#[test]
fn a_delta_on_a_projection_the_layer_lacks_is_refused() {
    let m = cpu("qwen35");
    let tmp = std::env::temp_dir().join(format!("wick-hybrid-lora-{}", std::process::id()));
    // Layer 2 of the tiny Qwen 3.5 is its full-attention layer: no DeltaNet projections.
    let dir = tmp.join("deltanet_on_full");
    one_delta(&dir, 2, "linear_attn.in_proj_qkv", [2, 64], [160, 2]);
    let err = load_host(&dir, m.config(), None).unwrap_err().to_string();
    assert!(err.contains("does not have"), "{err}");
    // A DeltaNet layer's in_proj_qkv of the right shape mounts.
    let ok = tmp.join("deltanet_on_linear");
    one_delta(&ok, 0, "linear_attn.in_proj_qkv", [2, 64], [160, 2]);
    load_host(&ok, m.config(), None).unwrap();
    // The gated q_proj holds query and gate rows: half of them does not fit.
    let half = tmp.join("q_without_gate");
    let q = m.config().num_heads * m.config().head_dim;
    one_delta(&half, 2, "self_attn.q_proj", [2, 64], [q, 2]);
    let err = load_host(&half, m.config(), None).unwrap_err().to_string();
    assert!(err.contains("needs"), "{err}");
    // Deltas on Gemma 4's stacked experts (PEFT's target_parameters, module `experts`):
    // their factors must fit one of the two stacked weights (hidden 48, inner 16, 8
    // experts), rank × experts wide, and a model without experts refuses them.
    let moe = cpu("gemma4_moe");
    let misfit = tmp.join("experts_misfit");
    one_delta(&misfit, 0, "experts", [16, 48], [33, 16]);
    let err = load_host(&misfit, moe.config(), None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("fit neither"), "{err}");
    let uneven = tmp.join("experts_uneven");
    one_delta(&uneven, 0, "experts", [3, 48], [32, 3]);
    let err = load_host(&uneven, moe.config(), None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rank × 8 experts"), "{err}");
    let fits = tmp.join("experts_fit");
    one_delta(&fits, 0, "experts", [16, 16], [48, 16]);
    let host = load_host(&fits, moe.config(), None).unwrap();
    assert_eq!(host.expert_deltas.len(), 1);
    assert_eq!(host.expert_deltas[0].part, ExpertPart::Down);
    assert_eq!(host.expert_deltas[0].rank, 2);
    let dense = cpu("gemma4");
    let err = load_host(&fits, dense.config(), None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not have"), "{err}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Adapters on the tiny Gemma 4 MoE's stacked experts (PEFT's `target_parameters`,
/// `goldens/adapters/experts`): every position within the adapter tests' 1e-4 of PEFT, in
/// one pass and in pieces, and rows on different adapters in one batch; the engine
/// mounts them on the CPU backend.
#[test]
fn expert_adapters_match_peft_at_every_position() {
    let g = ExpertAdapters::open();
    let m = cpu(ExpertAdapters::MODEL);
    g.check(&m, TOLERANCE);
    let model = Model::load(&golden_dir(ExpertAdapters::MODEL), &LoadOptions::default()).unwrap();
    let dir = goldens().join("adapters/experts/e");
    let adapter = model.load_adapter("e", &dir).unwrap();
    let layers = m.config().num_layers;
    assert!(
        adapter.info().mounted_layers > layers,
        "{:?}",
        adapter.info()
    );
}
