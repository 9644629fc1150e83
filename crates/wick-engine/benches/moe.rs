//! Gemma 4 mixture-of-experts feed-forward on the CPU: the gather-style expert products
//! (`Experts::forward_grouped`, each expert's rows gathered into one product) against a
//! per-token loop over each row's experts (`Experts::forward_per_token`).
//!
//! The routing is Gemma 4 26B-A4B's (128 experts, top 8); the matrices are scaled down
//! (hidden 512, expert inner size 256, f16 weights) to fit a small machine. Two batches of
//! 8 sequences: a decode step (8 rows, 64 row-expert pairs spread over ~50 experts) and a
//! prefill chunk of 32 tokens each (256 rows, ~16 rows per expert).
use std::borrow::Cow;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use wick_engine::backend::candle::CandleBackend;
use wick_engine::backend::{Activation, Backend, HostWeight};
use wick_engine::models::moe::{Experts, Routing};
use wick_gguf::GgmlType;

const EXPERTS: usize = 128;
const TOP_K: usize = 8;
const HIDDEN: usize = 512;
const INNER: usize = 256;

fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * 0.1
        })
        .collect()
}

fn f16_weight(name: &str, shape: Vec<usize>, seed: u64) -> HostWeight<'static> {
    let n = shape.iter().product();
    HostWeight {
        name: name.into(),
        dtype: GgmlType::F16,
        shape,
        bytes: Cow::Owned(
            noise(seed, n)
                .into_iter()
                .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
        ),
    }
}

fn bench(c: &mut Criterion) {
    let be = CandleBackend::cpu();
    let gate_up = f16_weight("gate_up", vec![EXPERTS, 2 * INNER, HIDDEN], 1);
    let down = f16_weight("down", vec![EXPERTS, HIDDEN, INNER], 2);
    let (experts, _) = Experts::upload(
        &be,
        &gate_up,
        &down,
        vec![1.0; EXPERTS],
        TOP_K,
        Activation::GeluTanh,
    )
    .expect("experts");
    drop((gate_up, down));
    let mut group = c.benchmark_group("gemma4_moe_8_sequences");
    group.sample_size(10);
    for (name, rows) in [("decode", 8usize), ("prefill_32", 8 * 32)] {
        let x = be
            .tensor_from_host(noise(3, rows * HIDDEN), rows, HIDDEN)
            .expect("x");
        let logits: Vec<f32> = noise(4, rows * EXPERTS).iter().map(|v| v * 40.0).collect();
        let routing =
            Routing::softmax_top_k(&logits, EXPERTS, TOP_K, &[1.0; EXPERTS]).expect("routing");
        group.bench_with_input(BenchmarkId::new("grouped", name), &rows, |b, _| {
            b.iter(|| black_box(experts.forward_grouped(&be, &x, &routing).expect("grouped")))
        });
        group.bench_with_input(BenchmarkId::new("per_token", name), &rows, |b, _| {
            b.iter(|| {
                black_box(
                    experts
                        .forward_per_token(&be, &x, &routing)
                        .expect("per token"),
                )
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
