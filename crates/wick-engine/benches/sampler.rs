//! Sampler speed on full-size vocabularies: Qwen2/3's 151,936 entries and Gemma 3's 262,144.
//!
//! The rows are pseudo-random but shaped like model output (a spread of a few logits, a
//! handful of strong tokens, a long tail), so the truncations see realistic nucleus sizes.
//! No processor is on, so `sample` leaves the row as it was and one row serves every
//! iteration.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use wick_engine::sampler::{Sampler, SamplerTokens, SamplingParams};

const VOCABS: [usize; 2] = [151_936, 262_144];

fn model_like_row(vocab: usize) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..vocab)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32;
            let v = ((state >> 16) & 0xffff) as f32 / 65536.0;
            4.0 * u - 12.0 * v * v + if state & 0x1fff == 0 { 9.0 } else { 0.0 }
        })
        .collect()
}

fn bench_sampler(c: &mut Criterion) {
    let cases: [(&str, SamplingParams); 6] = [
        ("greedy", SamplingParams::greedy()),
        (
            "greedy_top20_logprobs",
            SamplingParams {
                logprobs: Some(20),
                ..SamplingParams::greedy()
            },
        ),
        (
            "top_p_0.95",
            SamplingParams {
                temperature: 0.7,
                top_p: 0.95,
                ..SamplingParams::default()
            },
        ),
        (
            "top_k_20_top_p_0.8",
            SamplingParams {
                temperature: 0.7,
                top_p: 0.8,
                top_k: 20,
                ..SamplingParams::default()
            },
        ),
        (
            "min_p_0.05",
            SamplingParams {
                temperature: 1.0,
                min_p: 0.05,
                ..SamplingParams::default()
            },
        ),
        (
            "full_categorical",
            SamplingParams {
                temperature: 1.0,
                ..SamplingParams::default()
            },
        ),
    ];
    let mut group = c.benchmark_group("sampler");
    for vocab in VOCABS {
        let mut row = model_like_row(vocab);
        group.throughput(Throughput::Elements(vocab as u64));
        for (name, params) in &cases {
            let mut sampler =
                Sampler::new(params.clone(), SamplerTokens::default()).expect("valid params");
            group.bench_with_input(BenchmarkId::new(*name, vocab), &vocab, |b, _| {
                b.iter(|| black_box(sampler.sample(black_box(&mut row), &[])))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_sampler);
criterion_main!(benches);
