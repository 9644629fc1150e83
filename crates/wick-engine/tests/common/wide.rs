//! Wide models: random-weight two-layer Qwen 3 models with the attention shapes of real
//! models (head size 64–256, up to 32 query heads per KV head) that the tiny goldens do
//! not have, in f32 or MLX-quantized, and token ids to feed them.
use std::path::Path;

use super::golden::{golden_dir, read_json, write_safetensors, Tensor};

/// Writes into `dir` a random-weight two-layer Qwen 3 model (the qwen3 golden's config
/// with `heads` query heads over `kv_heads` KV heads of `head_dim` dimensions, hidden size
/// 64, vocabulary 512): attention shapes of real models (head size 128 or 256, 1–32 query
/// heads per KV head) that the tiny goldens do not have. Weights are uniform with unit
/// output variance, seeded by the shape.
pub fn write_wide_model(dir: &Path, heads: usize, kv_heads: usize, head_dim: usize) {
    let mut config = read_json(&golden_dir("qwen3").join("config.json"));
    config["num_attention_heads"] = heads.into();
    config["num_key_value_heads"] = kv_heads.into();
    config["head_dim"] = head_dim.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let (hidden, ffn, vocab) = (64usize, 128usize, 512usize);
    let mut tensors: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, hidden]),
        ("model.norm.weight".into(), vec![hidden]),
    ];
    for l in 0..2 {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![hidden]),
            ("post_attention_layernorm.weight", vec![hidden]),
            ("self_attn.q_proj.weight", vec![heads * head_dim, hidden]),
            ("self_attn.k_proj.weight", vec![kv_heads * head_dim, hidden]),
            ("self_attn.v_proj.weight", vec![kv_heads * head_dim, hidden]),
            ("self_attn.o_proj.weight", vec![hidden, heads * head_dim]),
            ("self_attn.q_norm.weight", vec![head_dim]),
            ("self_attn.k_norm.weight", vec![head_dim]),
            ("mlp.gate_proj.weight", vec![ffn, hidden]),
            ("mlp.up_proj.weight", vec![ffn, hidden]),
            ("mlp.down_proj.weight", vec![hidden, ffn]),
        ] {
            tensors.push((format!("{p}.{name}"), shape));
        }
    }
    let mut state = (heads * 1_000_003 + kv_heads * 1_009 + head_dim) as u64 | 1;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
    };
    let mut out = Vec::new();
    for (name, shape) in tensors {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = if shape.len() == 1 {
            (0..n).map(|_| 1.0 + 0.1 * uniform()).collect()
        } else {
            let a = if name.contains("embed") {
                1.0
            } else {
                (3.0 / shape[1] as f32).sqrt()
            };
            (0..n).map(|_| a * uniform()).collect()
        };
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        out.push((name, "F32".into(), shape, bytes));
    }
    write_safetensors(&dir.join("model.safetensors"), out);
}

/// The tensors of an all-f32 safetensors file (as [`write_wide_model`] writes it): name,
/// shape and little-endian bytes.
fn f32_tensors(file: &Path) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(name, info)| {
            assert_eq!(info["dtype"], "F32", "{name}");
            let shape: Vec<usize> = serde_json::from_value(info["shape"].clone()).unwrap();
            let [a, b] = [0, 1].map(|i| info["data_offsets"][i].as_u64().unwrap() as usize);
            (name.clone(), shape, bytes[8 + n + a..8 + n + b].to_vec())
        })
        .collect()
}

/// Rewrites the f32 `model.safetensors` of `dir` (as [`write_wide_model`] leaves it) in
/// MLX's affine layout, as `mlx_lm.convert -q` does: every matrix packed at `bits` with
/// scales and biases of type `side` per `group` inputs, and `quantization` in
/// `config.json`.
pub fn quantize_model(dir: &Path, bits: u32, group: usize, side: wick_gguf::GgmlType) {
    let file = dir.join("model.safetensors");
    let mut out: Vec<Tensor> = Vec::new();
    for (name, shape, raw) in f32_tensors(&file) {
        let values: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let [rows, cols] = shape[..] else {
            out.push((name, "F32".into(), shape, raw));
            continue;
        };
        let q = wick_engine::weights::AffineWeight::quantize(
            &name,
            &values,
            (rows, cols),
            (bits, group),
            side,
        )
        .unwrap();
        let module = name.strip_suffix(".weight").unwrap();
        let words = cols * bits as usize / 32;
        out.push((
            name.clone(),
            "U32".into(),
            vec![rows, words],
            q.packed.to_vec(),
        ));
        for (side, w) in [("scales", &q.scales), ("biases", &q.biases)] {
            out.push((
                format!("{module}.{side}"),
                w.dtype.to_string(),
                w.shape.clone(),
                w.bytes.to_vec(),
            ));
        }
    }
    write_safetensors(&file, out);
    let path = dir.join("config.json");
    let mut config = read_json(&path);
    config["quantization"] = serde_json::json!({"group_size": group, "bits": bits});
    std::fs::write(&path, config.to_string()).unwrap();
}

/// Rewrites the f32 matrices of `dir`'s `model.safetensors` (as [`write_wide_model`] leaves
/// it) as bf16, rounded to nearest even, as a checkpoint saved in bf16 holds them: the
/// weights GPU backends multiply with bf16 inputs on cuBLAS.
pub fn bf16_model(dir: &Path) {
    let file = dir.join("model.safetensors");
    let mut out: Vec<Tensor> = Vec::new();
    for (name, shape, raw) in f32_tensors(&file) {
        if shape.len() != 2 {
            out.push((name, "F32".into(), shape, raw));
            continue;
        }
        let halves = raw
            .chunks_exact(4)
            .flat_map(|c| {
                let v = f32::from_le_bytes(c.try_into().unwrap());
                half::bf16::from_f32(v).to_bits().to_le_bytes()
            })
            .collect();
        out.push((name, "BF16".into(), shape, halves));
    }
    write_safetensors(&file, out);
}

/// The attention shapes [`write_wide_model`] is used with: (query heads, KV heads, head
/// size) — Llama-3-like groups of 4 at 128, a group of 7 at 64 (Qwen2.5-0.5B), MHA,
/// groups of 8 and 32 at 128, Gemma's 256.
pub const WIDE_SHAPES: [(usize, usize, usize); 6] = [
    (8, 2, 128),
    (14, 2, 64),
    (4, 4, 128),
    (16, 2, 128),
    (32, 1, 128),
    (8, 2, 256),
];

/// Token ids below 512 (the wide models' vocabulary), seeded.
pub fn some_ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503))
                >> 7)
                % 512
        })
        .collect()
}
