//! The tiny llama the GGUF-writing tests build (`bad_models`, `draft_model`): one layer of
//! hidden size 32, two query heads over one KV head, fixed pseudo-random F32 weights; each
//! test adds its own vocabulary. Stands alone, so that a test includes it with
//! `#[path = "common/gguf.rs"] mod gguf;`.
#![allow(dead_code)] // each test crate uses its own subset

use wick_gguf::MetadataValue as V;

/// Hidden size of the tiny llama.
pub const HIDDEN: u64 = 32;
/// Feed-forward width of the tiny llama.
pub const FFN: u64 = 64;

/// `n` pseudo-random f32 values in [-0.1, 0.1), seeded, as little-endian bytes.
pub fn f32_bytes(n: usize, seed: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 5000.0 - 0.1)
                .to_le_bytes()
        })
        .collect()
}

/// The tiny llama's hyperparameters under architecture `arch` (`{arch}.block_count` …),
/// with a context of `context` tokens, in the order they are written.
pub fn hyperparameters(arch: &str, context: u32) -> Vec<(String, V)> {
    vec![
        (format!("{arch}.block_count"), V::U32(1)),
        (format!("{arch}.context_length"), V::U32(context)),
        (format!("{arch}.embedding_length"), V::U32(HIDDEN as u32)),
        (format!("{arch}.feed_forward_length"), V::U32(FFN as u32)),
        (format!("{arch}.attention.head_count"), V::U32(2)),
        (format!("{arch}.attention.head_count_kv"), V::U32(1)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            V::F32(1e-5),
        ),
    ]
}

/// The tiny llama's tensors over a vocabulary of `vocab` tokens: name and GGUF dims
/// (innermost first), in the order they are written.
pub fn tensors(vocab: u64) -> Vec<(&'static str, Vec<u64>)> {
    let (h, ff, kv) = (HIDDEN, FFN, HIDDEN / 2);
    vec![
        ("token_embd.weight", vec![h, vocab]),
        ("output_norm.weight", vec![h]),
        ("blk.0.attn_norm.weight", vec![h]),
        ("blk.0.ffn_norm.weight", vec![h]),
        ("blk.0.attn_q.weight", vec![h, h]),
        ("blk.0.attn_k.weight", vec![h, kv]),
        ("blk.0.attn_v.weight", vec![h, kv]),
        ("blk.0.attn_output.weight", vec![h, h]),
        ("blk.0.ffn_gate.weight", vec![h, ff]),
        ("blk.0.ffn_up.weight", vec![h, ff]),
        ("blk.0.ffn_down.weight", vec![ff, h]),
    ]
}
