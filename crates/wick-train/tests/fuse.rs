//! `wick fuse` on the tiny random Llama of `wick-engine/tests/goldens/hf/llama`: the fused
//! weights are `W + s·B·A` (f32 exactly up to summation order, bf16 within rounding, MLX
//! affine within a quantization step, GGUF in the file's Q/K row order), every other
//! tensor and file is carried over, and misfits are refused before anything is written.
use std::borrow::Cow;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use wick_engine::adapters::Target;
use wick_engine::config::ModelConfig;
use wick_engine::weights::{AffineWeight, HostWeight, SafetensorsWeights};
use wick_gguf::{GgmlType, GgufFile, GgufWriter, MetadataValue};
use wick_train::adapter_io::save_adapter;
use wick_train::fuse::{fuse, FusedDtype};
use wick_train::lora::{LoraConfig, LoraParams};

fn tiny() -> PathBuf {
    tiny_of("llama")
}

fn tiny_of(golden: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../wick-engine/tests/goldens/hf")
        .join(golden)
}

fn config(dir: &Path) -> ModelConfig {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    ModelConfig::from_hf(&serde_json::from_str(&text).unwrap(), "tiny").unwrap()
}

fn hf_name(layer: usize, t: Target) -> String {
    format!("model.layers.{layer}.{}.weight", t.hf_module())
}

/// A PEFT adapter with random A and B on the last layer's projections (rank 4, α 2).
fn adapter(dir: &Path, cfg: &ModelConfig) -> LoraParams {
    let lora = LoraConfig {
        rank: 4,
        scale: 2.0,
        num_layers: Some(1),
        ..LoraConfig::default()
    };
    let mut params = LoraParams::init(cfg, &lora, 7);
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    for pair in params.pairs_mut() {
        pair.b
            .iter_mut()
            .for_each(|v| *v = rng.random_range(-0.5..0.5));
    }
    save_adapter(dir, &params, &lora, cfg.num_layers, "tiny").unwrap();
    params
}

/// `W + 2·B·A` in f32, row-major `[out, in]`.
fn expected(w: &[f32], params: &LoraParams, layer: usize, t: Target) -> Vec<f32> {
    let p = params.layers[layer][t.index()].as_ref().unwrap();
    let (out, inp, r) = (p.out_dim, p.in_dim, params.rank);
    let mut v = w.to_vec();
    for o in 0..out {
        for i in 0..inp {
            let s: f32 = (0..r).map(|k| p.b[o * r + k] * p.a[k * inp + i]).sum();
            v[o * inp + i] += 2.0 * s;
        }
    }
    v
}

fn floats(st: &SafetensorsWeights, name: &str) -> Vec<f32> {
    st.raw(name).unwrap().dequantize().unwrap()
}

/// A safetensors file of `(name, dtype, shape, bytes)`.
fn write_safetensors(path: &Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}),
        );
        offset += bytes.len();
    }
    let head = Value::Object(header).to_string().into_bytes();
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    for (_, _, _, bytes) in tensors {
        out.extend_from_slice(bytes);
    }
    std::fs::write(path, out).unwrap();
}

/// The tiny model's folder with its weights rewritten by `convert` (name, f32 values,
/// shape → tensors to store) and `config.json` edited by `edit`.
fn variant(
    dir: &Path,
    convert: impl Fn(&str, Vec<f32>, Vec<usize>) -> Vec<(String, &'static str, Vec<usize>, Vec<u8>)>,
    edit: impl Fn(&mut Value),
) -> PathBuf {
    let src = tiny();
    let base = dir.join("base");
    std::fs::create_dir_all(&base).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), base.join(f)).unwrap();
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(base.join("config.json"), cfg.to_string()).unwrap();
    let st = SafetensorsWeights::open(&src).unwrap();
    let mut names: Vec<&str> = st.names().collect();
    names.sort_unstable();
    let tensors: Vec<_> = names
        .iter()
        .flat_map(|n| convert(n, floats(&st, n), st.raw(n).unwrap().shape.clone()))
        .collect();
    write_safetensors(&base.join("model.safetensors"), &tensors);
    base
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn an_f32_folder_fuses_to_w_plus_sba_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&tiny());
    let params = adapter(&dir.path().join("adapter"), &cfg);
    let out = dir.path().join("fused");
    let report = fuse(&tiny(), &dir.path().join("adapter"), &out).unwrap();
    assert_eq!(report.modules, 7);
    assert_eq!(report.dtype, FusedDtype::Float(GgmlType::F32));
    assert_eq!(report.model_path, out);
    let names: Vec<&str> = report.files.iter().map(|f| f.0.as_str()).collect();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(names.contains(&f), "{f} missing from {names:?}");
    }
    let base = SafetensorsWeights::open(&tiny()).unwrap();
    let fused = SafetensorsWeights::open(&out).unwrap();
    assert_eq!(base.names().count(), fused.names().count());
    for name in base.names() {
        let changed = Target::ALL.iter().find(|&&t| name == hf_name(1, t));
        let got = floats(&fused, name);
        match changed {
            Some(&t) => {
                let want = expected(&floats(&base, name), &params, 1, t);
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                        "{name}: {g} vs {w}"
                    );
                }
            }
            None => assert_eq!(
                base.raw(name).unwrap().bytes,
                fused.raw(name).unwrap().bytes,
                "{name} changed"
            ),
        }
    }
    // The output exists now: a second fuse into it is refused, and nothing is left behind.
    let again = fuse(&tiny(), &dir.path().join("adapter"), &out).unwrap_err();
    assert!(again.to_string().contains("already exists"), "{again}");
    let hidden: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(hidden.is_empty(), "temporary folders left: {hidden:?}");
}

/// Phi-3 stores `qkv_proj` and `gate_up_proj` fused, and PEFT adapts each as one module
/// (one `A`, one `B` whose rows are the parts'): the adapter folds into the fused matrices
/// whole, queries, keys and values (gate, up) each at their rows, as `W + s·B·A` of the
/// module.
#[test]
fn fused_modules_fold_into_a_base_that_stores_them_fused() {
    let dir = tempfile::tempdir().unwrap();
    let base_dir = tiny_of("phi3");
    let cfg = config(&base_dir);
    let params = adapter(&dir.path().join("adapter"), &cfg);
    let out = dir.path().join("fused");
    let report = fuse(&base_dir, &dir.path().join("adapter"), &out).unwrap();
    assert_eq!(
        report.modules, 4,
        "qkv_proj, o_proj, gate_up_proj, down_proj"
    );
    let base = SafetensorsWeights::open(&base_dir).unwrap();
    let fused = SafetensorsWeights::open(&out).unwrap();
    let modules = [
        (Target::Q, "self_attn.qkv_proj"),
        (Target::O, "self_attn.o_proj"),
        (Target::Gate, "mlp.gate_up_proj"),
        (Target::Down, "mlp.down_proj"),
    ];
    let mut seen = 0;
    for name in base.names() {
        let changed = modules
            .iter()
            .find(|(_, m)| name == format!("model.layers.1.{m}.weight"));
        let got = floats(&fused, name);
        match changed {
            Some(&(t, _)) => {
                seen += 1;
                let want = expected(&floats(&base, name), &params, 1, t);
                assert_eq!(got.len(), want.len(), "{name}");
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                        "{name}: {g} vs {w}"
                    );
                }
            }
            None => assert_eq!(
                base.raw(name).unwrap().bytes,
                fused.raw(name).unwrap().bytes,
                "{name} changed"
            ),
        }
    }
    assert_eq!(seen, 4);
}

#[test]
fn a_bf16_folder_stays_bf16_within_rounding() {
    let dir = tempfile::tempdir().unwrap();
    let to_bf16 = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect()
    };
    let base = variant(
        dir.path(),
        |n, v, shape| vec![(n.to_string(), "BF16", shape, to_bf16(&v))],
        |c| c["dtype"] = json!("bfloat16"),
    );
    let cfg = config(&base);
    let params = adapter(&dir.path().join("adapter"), &cfg);
    let out = dir.path().join("fused");
    let report = fuse(&base, &dir.path().join("adapter"), &out).unwrap();
    assert_eq!(report.dtype, FusedDtype::Float(GgmlType::Bf16));
    let (b, f) = (
        SafetensorsWeights::open(&base).unwrap(),
        SafetensorsWeights::open(&out).unwrap(),
    );
    for t in Target::ALL {
        let name = hf_name(1, t);
        assert_eq!(f.raw(&name).unwrap().dtype, GgmlType::Bf16);
        let want = expected(&floats(&b, &name), &params, 1, t);
        for (g, w) in floats(&f, &name).iter().zip(&want) {
            // bf16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of it.
            assert!(
                (g - w).abs() <= w.abs() * 2f32.powi(-8) + 1e-6,
                "{name}: {g} vs {w}"
            );
        }
    }
}

/// Module `module`'s packed matrix and its scales and biases.
fn affine<'a>(
    st: &'a SafetensorsWeights,
    module: &str,
    (bits, group_size): (u32, usize),
) -> AffineWeight<'a> {
    let (packed, shape) = st.packed(&format!("{module}.weight")).unwrap();
    let side = |s: &str| st.raw(&format!("{module}.{s}")).unwrap();
    AffineWeight {
        name: module.to_string(),
        rows: shape[0],
        cols: shape[1] * 32 / bits as usize,
        bits,
        group_size,
        packed: Cow::Borrowed(packed),
        scales: side("scales"),
        biases: side("biases"),
    }
}

#[test]
fn an_mlx_quantized_folder_keeps_each_modules_bits_and_group_size() {
    let dir = tempfile::tempdir().unwrap();
    // 4-bit groups of 32, except layer 1's down projection at 8 bits in groups of 64.
    let params_of = |n: &str| {
        if n.contains("layers.1.mlp.down_proj") {
            (8, 64)
        } else {
            (4, 32)
        }
    };
    let base = variant(
        dir.path(),
        |n, v, shape| {
            let is_projection = n.contains("_proj.weight");
            if !is_projection {
                return vec![(n.to_string(), "F32", shape, f32_bytes(&v))];
            }
            let module = n.strip_suffix(".weight").unwrap();
            let q =
                AffineWeight::quantize(n, &v, (shape[0], shape[1]), params_of(n), GgmlType::F16)
                    .unwrap();
            let words = shape[1] * q.bits as usize / 32;
            vec![
                (
                    n.to_string(),
                    "U32",
                    vec![shape[0], words],
                    q.packed.into_owned(),
                ),
                (
                    format!("{module}.scales"),
                    "F16",
                    q.scales.shape.clone(),
                    q.scales.bytes.into_owned(),
                ),
                (
                    format!("{module}.biases"),
                    "F16",
                    q.biases.shape.clone(),
                    q.biases.bytes.into_owned(),
                ),
            ]
        },
        |c| {
            c["quantization"] = json!({"group_size": 32, "bits": 4,
                "model.layers.1.mlp.down_proj": {"group_size": 64, "bits": 8}});
        },
    );
    let cfg = config(&base);
    let params = adapter(&dir.path().join("adapter"), &cfg);
    let out = dir.path().join("fused");
    let report = fuse(&base, &dir.path().join("adapter"), &out).unwrap();
    assert!(matches!(report.dtype, FusedDtype::MlxAffine { .. }));
    let (b, f) = (
        SafetensorsWeights::open(&base).unwrap(),
        SafetensorsWeights::open(&out).unwrap(),
    );
    for layer in 0..2 {
        for t in Target::ALL {
            let module = format!("model.layers.{layer}.{}", t.hf_module());
            let q = params_of(&module);
            let (bw, fw) = (affine(&b, &module, q), affine(&f, &module, q));
            if layer == 0 {
                assert_eq!(bw.packed, fw.packed, "{module} changed");
                continue;
            }
            assert_eq!(fw.scales.dtype, GgmlType::F16);
            let want = expected(&bw.dequantize().unwrap(), &params, 1, t);
            let got = fw.dequantize().unwrap();
            let steps = fw.scales.dequantize().unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // MLX's quantizer keeps zero exact, which may cost the far edge a step.
                let step = steps[i / q.1].abs();
                assert!(
                    (g - w).abs() <= 1.05 * step + 1e-3,
                    "{module}[{i}]: {g} vs {w}"
                );
            }
        }
    }
    // The trainer's loader (the engine's names and dequantization) reads the result.
    wick_train::base::BaseWeights::load(&out).unwrap();
}

/// llama.cpp's Q/K order: within each head, file row `2j + t` is Hugging Face row
/// `t·hd/2 + j`.
fn to_file_rows(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let hd = w.len() / cols / heads;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for j in 0..hd / 2 {
            for t in 0..2 {
                let (file, hf) = (h * hd + 2 * j + t, h * hd + t * hd / 2 + j);
                out[file * cols..(file + 1) * cols].copy_from_slice(&w[hf * cols..(hf + 1) * cols]);
            }
        }
    }
    out
}

#[test]
fn a_gguf_file_fuses_in_its_own_row_order_and_quantized_matrices_become_f16() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny();
    let cfg = config(&src);
    let st = SafetensorsWeights::open(&src).unwrap();
    let mut w = GgufWriter::new();
    let s = |v: &str| MetadataValue::String(v.into());
    w.metadata("general.architecture", s("llama"))
        .metadata("llama.embedding_length", MetadataValue::U32(64))
        .metadata("llama.block_count", MetadataValue::U32(2))
        .metadata("llama.feed_forward_length", MetadataValue::U32(128))
        .metadata("llama.attention.head_count", MetadataValue::U32(4))
        .metadata("llama.attention.head_count_kv", MetadataValue::U32(2))
        .metadata("llama.context_length", MetadataValue::U32(2048))
        .metadata(
            "llama.attention.layer_norm_rms_epsilon",
            MetadataValue::F32(1e-5),
        )
        .metadata("llama.vocab_size", MetadataValue::U32(512));
    let stems = [
        (Target::Q, 4),
        (Target::K, 2),
        (Target::V, 0),
        (Target::O, 0),
        (Target::Gate, 0),
        (Target::Up, 0),
        (Target::Down, 0),
    ];
    // Every matrix F32, except layer 1's up projection in Q8_0 (a quantized type).
    let mut hf_weights = Vec::new();
    for layer in 0..2 {
        for (t, heads) in stems {
            let name = hf_name(layer, t);
            let v = floats(&st, &name);
            let shape = st.raw(&name).unwrap().shape.clone();
            let file_v = if heads > 0 {
                to_file_rows(&v, heads, shape[1])
            } else {
                v.clone()
            };
            let dims = vec![shape[1] as u64, shape[0] as u64];
            let gg = format!("blk.{layer}.{}.weight", t.gguf_stem().unwrap());
            if layer == 1 && t == Target::Up {
                let q8 = quantize_q8_0(&file_v);
                w.tensor(gg, dims, GgmlType::Q8_0, q8);
            } else {
                w.tensor(gg, dims, GgmlType::F32, f32_bytes(&file_v));
            }
            hf_weights.push((layer, t, v));
        }
    }
    let gguf = dir.path().join("tiny.gguf");
    std::fs::write(&gguf, w.to_bytes()).unwrap();
    let params = adapter(&dir.path().join("adapter"), &cfg);
    let out = dir.path().join("fused");
    let report = fuse(&gguf, &dir.path().join("adapter"), &out).unwrap();
    assert_eq!(report.model_path, out.join("tiny-fused.gguf"));
    let fused = GgufFile::open(&report.model_path).unwrap();
    assert_eq!(fused.metadata().get_u64("llama.block_count").unwrap(), 2);
    let base = GgufFile::open(&gguf).unwrap();
    for (layer, t, hf) in &hf_weights {
        let name = format!("blk.{layer}.{}.weight", t.gguf_stem().unwrap());
        let view = fused.tensor(&name).unwrap();
        let weight = HostWeight {
            name: name.clone(),
            dtype: view.info.dtype,
            shape: view.info.shape(),
            bytes: Cow::Borrowed(view.data),
        };
        if *layer == 0 {
            assert_eq!(
                view.data,
                base.tensor(&name).unwrap().data,
                "{name} changed"
            );
            continue;
        }
        let heads = stems.iter().find(|s| s.0 == *t).unwrap().1;
        let cols = view.info.shape()[1];
        let start = if *t == Target::Up {
            // The Q8_0 base, as the engine dequantizes it.
            let b = base.tensor(&name).unwrap();
            HostWeight {
                name: name.clone(),
                dtype: GgmlType::Q8_0,
                shape: b.info.shape(),
                bytes: Cow::Borrowed(b.data),
            }
            .dequantize()
            .unwrap()
        } else {
            hf.clone()
        };
        let mut want = expected(&start, &params, 1, *t);
        if heads > 0 {
            want = to_file_rows(&want, heads, cols);
        }
        let (want_type, tol) = if *t == Target::Up {
            (GgmlType::F16, 2f32.powi(-11))
        } else {
            (GgmlType::F32, 1e-5)
        };
        assert_eq!(view.info.dtype, want_type, "{name}");
        for (g, w) in weight.dequantize().unwrap().iter().zip(&want) {
            assert!(
                (g - w).abs() <= tol * w.abs().max(1.0),
                "{name}: {g} vs {w}"
            );
        }
    }
    assert_eq!(
        report.dtype,
        FusedDtype::Float(GgmlType::F32),
        "the first changed matrix is F32"
    );
}

/// ggml's Q8_0: blocks of 32 values as an f16 scale and 32 signed bytes.
fn quantize_q8_0(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in v.chunks(32) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|x| (x * inv).round() as i8 as u8));
    }
    out
}

#[test]
fn an_adapter_for_another_base_is_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let mut other: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("config.json")).unwrap())
            .unwrap();
    other["intermediate_size"] = json!(96);
    let cfg = ModelConfig::from_hf(&other, "other").unwrap();
    adapter(&dir.path().join("adapter"), &cfg);
    let out = dir.path().join("fused");
    let err = fuse(&tiny(), &dir.path().join("adapter"), &out).unwrap_err();
    assert!(err.to_string().contains("shape"), "{err}");
    assert!(!out.exists());
}

/// An adapter on the projections the hybrid families add (Qwen 3.5's DeltaNet layers and
/// gated query) is served beside the base but not folded: `wick fuse` refuses it whole,
/// naming the projection, and writes nothing.
#[test]
fn hybrid_family_projections_are_refused() {
    let goldens = Path::new(env!("CARGO_MANIFEST_DIR")).join("../wick-engine/tests/goldens");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fused");
    let err = fuse(
        &goldens.join("hf/qwen35"),
        &goldens.join("adapters/hybrid/qwen35/a"),
        &out,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("folds the seven dense projections only"),
        "{err}"
    );
    assert!(!out.exists());
}
