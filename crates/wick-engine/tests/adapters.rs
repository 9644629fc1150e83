//! LoRA adapters against transformers + PEFT (scripts/goldens/peft_adapters.py): PEFT and
//! mlx-lm adapters on the tiny random Llama, alone, stacked and none, must give PEFT's
//! logits within 1e-4; rows with different adapters in one batch must give each one's
//! logits; an adapter that does not fit the base is refused whole.
use std::path::Path;
use std::sync::Arc;

use wick_engine::adapters::{AdapterDtype, AdapterRegistry, AdapterStack, FactorDtype};
use wick_engine::weights::SafetensorsWeights;
use wick_engine::{
    EngineError, LoadOptions, Logits, LogitsRequest, Model, RowOutput, Step, StepPlan, StepRow,
    Want,
};

const TOLERANCE: f32 = 1e-4;
const ADAPTERS: [&str; 3] = ["peft_a", "peft_b", "mlx_c"];
const SELECTIONS: [&str; 6] = [
    "none",
    "peft_a",
    "peft_b",
    "mlx_c",
    "peft_a+mlx_c",
    "peft_a+peft_b",
];

mod common;
use common::golden::{
    floats, golden_dir, goldens, ids_of, read_json, stored_logits, write_safetensors,
};
use common::logits::assert_relative;
use common::serving::replies;

struct Fixture {
    model: Model,
    registry: AdapterRegistry,
    reference: serde_json::Value,
    logits: SafetensorsWeights,
}

fn fixture() -> Fixture {
    let model = Model::load(&golden_dir("llama"), &LoadOptions::default()).unwrap();
    let registry = AdapterRegistry::default();
    for id in ADAPTERS {
        let a = model
            .load_adapter(id, &goldens().join("adapters").join(id))
            .unwrap();
        registry.insert(Arc::new(a)).unwrap();
    }
    let dir = goldens().join("adapters");
    let reference = read_json(&dir.join("reference.json"));
    let logits = stored_logits(&dir);
    Fixture {
        model,
        registry,
        reference,
        logits,
    }
}

impl Fixture {
    fn ids(&self, case: &str) -> Vec<u32> {
        ids_of(&self.reference["cases"][case])
    }

    fn expected(&self, sel: &str, case: &str) -> Vec<f32> {
        floats(&self.logits, &format!("{sel}.{case}.logits"))
    }

    fn stack(&self, sel: &str) -> AdapterStack {
        self.registry.resolve(Some(sel)).unwrap()
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_relative(what, got, want, TOLERANCE);
}

#[test]
fn each_selection_matches_peft() {
    let f = fixture();
    for sel in SELECTIONS {
        let stack = f.stack(sel);
        for case in ["len7", "len19"] {
            let ids = f.ids(case);
            let mut cache = f.model.new_cache();
            let mut steps = [Step {
                tokens: &ids,
                cache: &mut cache,
                logits: LogitsRequest::All,
            }];
            let out = logits_with(&f.model, &mut steps, &[&stack]);
            let got = out[0].as_ref().unwrap();
            assert_close(&format!("{sel} {case}"), &got.data, &f.expected(sel, case));
        }
    }
}

#[test]
fn adapters_differ_from_the_base() {
    // The goldens are only worth something if each adapter moves the logits.
    let f = fixture();
    for sel in &SELECTIONS[1..] {
        let d = f.reference["selections"][sel]["max_abs_diff_from_base"]["len7"]
            .as_f64()
            .unwrap();
        assert!(d > 0.1, "{sel} changes the logits by only {d}");
    }
}

#[test]
fn mixed_batch_rows_get_their_own_adapters() {
    // One forward pass: a prompt per selection, prefilled together, then decode steps
    // of one token each, also together; every row must match its selection alone.
    let f = fixture();
    let stacks: Vec<AdapterStack> = SELECTIONS.iter().map(|s| f.stack(s)).collect();
    let refs: Vec<&AdapterStack> = stacks.iter().collect();
    let ids = f.ids("len19");
    let split = 12;
    let mut caches: Vec<_> = SELECTIONS.iter().map(|_| f.model.new_cache()).collect();
    let mut steps: Vec<Step<'_>> = caches
        .iter_mut()
        .map(|c| Step {
            tokens: &ids[..split],
            cache: c,
            logits: LogitsRequest::All,
        })
        .collect();
    let prefill = logits_with(&f.model, &mut steps, &refs);
    let vocab = f.model.config().vocab_size;
    for (sel, out) in SELECTIONS.iter().zip(&prefill) {
        let want = f.expected(sel, "len19");
        let got = out.as_ref().unwrap();
        assert_close(
            &format!("batched prefill {sel}"),
            &got.data,
            &want[..split * vocab],
        );
    }
    for pos in split..ids.len() {
        let mut steps: Vec<Step<'_>> = caches
            .iter_mut()
            .map(|c| Step {
                tokens: &ids[pos..pos + 1],
                cache: c,
                logits: LogitsRequest::Last,
            })
            .collect();
        let out = logits_with(&f.model, &mut steps, &refs);
        for (sel, o) in SELECTIONS.iter().zip(&out) {
            let want = f.expected(sel, "len19");
            assert_close(
                &format!("batched decode {sel} at {pos}"),
                o.as_ref().unwrap().last(),
                &want[pos * vocab..(pos + 1) * vocab],
            );
        }
    }
}

#[test]
fn argmax_path_uses_the_adapters() {
    let f = fixture();
    let stacks: Vec<AdapterStack> = SELECTIONS.iter().map(|s| f.stack(s)).collect();
    let refs: Vec<&AdapterStack> = stacks.iter().collect();
    let ids = f.ids("len7");
    let mut caches: Vec<_> = SELECTIONS.iter().map(|_| f.model.new_cache()).collect();
    let mut steps: Vec<Step<'_>> = caches
        .iter_mut()
        .map(|c| Step {
            tokens: &ids,
            cache: c,
            logits: LogitsRequest::Last,
        })
        .collect();
    let got = tokens_with(&f.model, &mut steps, &refs);
    for (sel, id) in SELECTIONS.iter().zip(got) {
        let want = f.reference["selections"][sel]["greedy"]["len7"][0]
            .as_u64()
            .unwrap() as u32;
        assert_eq!(id, Some(want), "{sel}");
    }
}

/// Writes a safetensors file of f32 tensors of zeros.
fn write_zeros(path: &Path, tensors: &[(&str, Vec<usize>)]) {
    let tensors = tensors
        .iter()
        .map(|(name, shape)| {
            let zeros = vec![0u8; shape.iter().product::<usize>() * 4];
            (name.to_string(), "F32".into(), shape.clone(), zeros)
        })
        .collect();
    write_safetensors(path, tensors);
}

#[test]
fn a_shape_that_does_not_fit_refuses_the_whole_adapter() {
    let model = Model::load(&golden_dir("llama"), &LoadOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("adapter_config.json"),
        r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 4}"#,
    )
    .unwrap();
    let p = "base_model.model.model.layers";
    write_zeros(
        &dir.path().join("adapter_model.safetensors"),
        &[
            // Layer 0's q_proj fits (hidden 64, q 64) ...
            (
                &format!("{p}.0.self_attn.q_proj.lora_A.weight"),
                vec![2, 64],
            ),
            (
                &format!("{p}.0.self_attn.q_proj.lora_B.weight"),
                vec![64, 2],
            ),
            // ... layer 1's down_proj (in = ffn 128) does not.
            (&format!("{p}.1.mlp.down_proj.lora_A.weight"), vec![2, 64]),
            (&format!("{p}.1.mlp.down_proj.lora_B.weight"), vec![64, 2]),
        ],
    );
    let err = model.load_adapter("bad", dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, EngineError::Adapter(_)), "{msg}");
    assert!(
        msg.contains("down_proj") && msg.contains("[rank, 128]"),
        "{msg}"
    );

    // A layer the base does not have.
    write_zeros(
        &dir.path().join("adapter_model.safetensors"),
        &[
            (
                &format!("{p}.7.self_attn.q_proj.lora_A.weight"),
                vec![2, 64],
            ),
            (
                &format!("{p}.7.self_attn.q_proj.lora_B.weight"),
                vec![64, 2],
            ),
        ],
    );
    let msg = model
        .load_adapter("bad", dir.path())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("layer 7"), "{msg}");

    // An A without its B.
    write_zeros(
        &dir.path().join("adapter_model.safetensors"),
        &[(
            &format!("{p}.0.self_attn.q_proj.lora_A.weight"),
            vec![2, 64],
        )],
    );
    let msg = model
        .load_adapter("bad", dir.path())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("without"), "{msg}");

    // No weights at all, and a bad id.
    let empty = tempfile::tempdir().unwrap();
    let msg = model
        .load_adapter("x", empty.path())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("no adapter weights"), "{msg}");
    let msg = model
        .load_adapter("a+b", &goldens().join("adapters/peft_a"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("invalid adapter id"), "{msg}");
}

#[test]
fn selection_errors_list_the_mounted_adapters() {
    let f = fixture();
    let msg = f.registry.resolve(Some("nope")).unwrap_err().to_string();
    assert!(
        msg.contains("'nope'") && msg.contains("mlx_c, peft_a, peft_b"),
        "{msg}"
    );
    let msg = f
        .registry
        .resolve(Some("peft_a+peft_a"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("twice"), "{msg}");
    assert!(f.registry.resolve(Some("none")).unwrap().is_empty());
    assert!(f.registry.resolve(None).unwrap().is_empty());
    f.registry.set_default("peft_b").unwrap();
    assert_eq!(f.registry.resolve(None).unwrap().name(), "peft_b");
    assert!(f.registry.resolve(Some("none")).unwrap().is_empty());
    // Namespaces differ per set and order.
    let ab = f.stack("peft_a+peft_b").cache_namespace();
    let ba = f.stack("peft_b+peft_a").cache_namespace();
    assert_ne!(ab, ba);
    assert_ne!(f.stack("peft_a").cache_namespace(), "");
}

#[test]
fn a_llama_cpp_gguf_adapter_gives_the_peft_logits() {
    // peft_a rewritten the way llama.cpp's convert_lora_to_gguf.py writes it: A and B
    // unchanged (ggml dims innermost first), alpha in the metadata (scale alpha / r = 2).
    let src = goldens().join("adapters/peft_a");
    let st =
        SafetensorsWeights::open_files(&src, &[src.join("adapter_model.safetensors")]).unwrap();
    let stems = [
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    let mut w = wick_gguf::GgufWriter::new();
    w.metadata(
        "general.architecture",
        wick_gguf::MetadataValue::String("llama".into()),
    );
    w.metadata(
        "general.type",
        wick_gguf::MetadataValue::String("adapter".into()),
    );
    w.metadata(
        "adapter.type",
        wick_gguf::MetadataValue::String("lora".into()),
    );
    w.metadata("adapter.lora.alpha", wick_gguf::MetadataValue::F32(8.0));
    for layer in 0..2 {
        for (hf, gg) in stems {
            for (f, suffix) in [("A", "lora_a"), ("B", "lora_b")] {
                let name = format!("base_model.model.model.layers.{layer}.{hf}.lora_{f}.weight");
                let t = st.raw(&name).unwrap();
                let dims = t.shape.iter().rev().map(|&d| d as u64).collect();
                w.tensor(
                    format!("blk.{layer}.{gg}.weight.{suffix}"),
                    dims,
                    wick_gguf::GgmlType::F32,
                    t.bytes.to_vec(),
                );
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("peft_a.gguf");
    std::fs::write(&file, w.to_bytes()).unwrap();

    let f = fixture();
    let a = f.model.load_adapter("gguf_a", &file).unwrap();
    assert_eq!(a.info().mounted_layers, 14);
    assert_eq!(a.info().scale, 2.0);
    let stack = AdapterStack::new(vec![Arc::new(a)]).unwrap();
    let ids = f.ids("len7");
    let mut cache = f.model.new_cache();
    let mut steps = [Step {
        tokens: &ids,
        cache: &mut cache,
        logits: LogitsRequest::All,
    }];
    let out = logits_with(&f.model, &mut steps, &[&stack]);
    assert_close(
        "gguf peft_a",
        &out[0].as_ref().unwrap().data,
        &f.expected("peft_a", "len7"),
    );
    // A GGUF model file is not an adapter.
    let mut m = wick_gguf::GgufWriter::new();
    m.metadata(
        "general.type",
        wick_gguf::MetadataValue::String("model".into()),
    );
    let model_file = dir.path().join("model.gguf");
    std::fs::write(&model_file, m.to_bytes()).unwrap();
    let msg = f
        .model
        .load_adapter("m", &model_file)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("not a GGUF adapter"), "{msg}");
}

/// Speculative decoding with adapters: the drafts are verified with the row's own
/// adapters, so greedy output equals the plain engine's for every selection, in one batch.
#[test]
fn speculative_rows_keep_their_adapters() {
    use wick_engine::scheduler::{Engine, EngineConfig};
    use wick_engine::speculative::SpeculativeConfig;
    let f = fixture();
    let mut prompt = f.ids("len19");
    prompt.extend(f.ids("len19"));
    let requests: Vec<_> = ["none", "peft_a", "peft_a+mlx_c", "mlx_c"]
        .iter()
        .map(|sel| {
            let mut r = wick_engine::GenerationRequest::new(prompt.clone())
                .max_tokens(24)
                .adapters(f.stack(sel));
            r.ignore_eos = true;
            r
        })
        .collect();
    let model = Arc::new(f.model);
    let run = |speculative: Option<SpeculativeConfig>| {
        let config = EngineConfig {
            prompt_cache_bytes: 0,
            speculative,
            ..EngineConfig::default()
        };
        let engine = Engine::start(model.clone(), config).unwrap();
        let outputs = replies(&engine, &requests);
        let stats = engine.stats();
        assert!(engine.shutdown(std::time::Duration::from_secs(5)));
        (outputs, stats.speculation)
    };
    let (plain, _) = run(None);
    // Every draft verified, so the count does not hang on step timings.
    let (spec, counts) = run(Some(SpeculativeConfig {
        budget: false,
        ..SpeculativeConfig::default()
    }));
    assert_eq!(spec, plain);
    assert!(counts.drafted > 0, "{counts:?}");
}

/// Issue 18, half-precision factors: on the f32 golden base `auto` keeps the golden
/// adapters' f32 factors (their values are not exact in f16), so the PEFT tolerances
/// above are unchanged; forced to f16 they take half the bytes, get another cache digest
/// and stay close to PEFT's logits, also stacked with an f32 adapter in one batch.
#[test]
fn half_precision_factors() {
    let mut f = fixture();
    for a in f.registry.list() {
        assert_eq!(a.info().factor_dtype, FactorDtype::F32, "{}", a.id());
    }
    f.model.set_adapter_dtype(AdapterDtype::F16);
    let dir = goldens().join("adapters");
    let half = Arc::new(f.model.load_adapter("peft_a", &dir.join("peft_a")).unwrap());
    let full = f.registry.get("peft_a").unwrap();
    assert_eq!(half.info().factor_dtype, FactorDtype::F16);
    assert_eq!(half.info().size_bytes * 2, full.info().size_bytes);
    assert_ne!(half.info().digest, full.info().digest);
    let stacks = [
        AdapterStack::new(vec![half.clone()]).unwrap(),
        AdapterStack::new(vec![half, f.registry.get("peft_b").unwrap()]).unwrap(),
    ];
    let ids = f.ids("len7");
    let mut caches = [f.model.new_cache(), f.model.new_cache()];
    let [c0, c1] = &mut caches;
    let mut steps = [
        Step {
            tokens: &ids,
            cache: c0,
            logits: LogitsRequest::All,
        },
        Step {
            tokens: &ids,
            cache: c1,
            logits: LogitsRequest::All,
        },
    ];
    let out = logits_with(&f.model, &mut steps, &[&stacks[0], &stacks[1]]);
    for (got, sel) in out.iter().zip(["peft_a", "peft_a+peft_b"]) {
        let got = &got.as_ref().unwrap().data;
        let want = f.expected(sel, "len7");
        assert_relative(&format!("{sel} in f16"), got, &want, 1e-2);
    }
}

/// One pass of `steps` (each wanting logits of its positions), step `i` under
/// `stacks[i]`.
fn logits_with(
    model: &Model,
    steps: &mut [Step<'_>],
    stacks: &[&AdapterStack],
) -> Vec<Option<Logits>> {
    run_with(model, steps, stacks, false)
        .into_iter()
        .map(|o| match o {
            RowOutput::Logits(l) => Some(l),
            _ => None,
        })
        .collect()
}

/// One pass of `steps`, each wanting the argmax of its last position, step `i` under
/// `stacks[i]`.
fn tokens_with(
    model: &Model,
    steps: &mut [Step<'_>],
    stacks: &[&AdapterStack],
) -> Vec<Option<u32>> {
    run_with(model, steps, stacks, true)
        .into_iter()
        .map(|o| match o {
            RowOutput::Token(t) => Some(t),
            _ => None,
        })
        .collect()
}

fn run_with(
    model: &Model,
    steps: &mut [Step<'_>],
    stacks: &[&AdapterStack],
    token: bool,
) -> Vec<RowOutput> {
    let rows = steps
        .iter_mut()
        .enumerate()
        .map(|(i, s)| StepRow {
            tokens: s.tokens,
            cache: &mut *s.cache,
            want: if token {
                Want::Token
            } else {
                Want::logits(s.logits)
            },
            adapters: stacks.get(i).copied(),
        })
        .collect();
    model.execute(StepPlan::new(rows)).unwrap()
}
