//! CPU attention over the paged KV cache, shaped like a batched decode step: every layer of
//! a SmolLM2-135M-like model (30 layers, 9 query heads over 3 KV heads of 64 dims) for 1 and
//! 8 sequences of ~300 tokens, one new token each; and a Qwen2.5-0.5B-like shape (14 over 2).
//! All layers' caches are distinct, so the KV reads come from memory as in a real step.
//! Also a 512-token prompt chunk of one sequence (prefill).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use wick_engine::backend::candle::{CandleBackend, CpuKvLayer, HostTensor, KvDtype};
use wick_engine::backend::{AttentionParams, AttentionSegment, Backend, KvLayer};

fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

struct Shape {
    name: &'static str,
    layers: usize,
    params: AttentionParams,
}

fn shapes() -> [Shape; 2] {
    let params = |heads, kv_heads| AttentionParams {
        heads,
        kv_heads,
        head_dim: 64,
        scale: 0.125,
        window: None,
        softcap: None,
    };
    [
        Shape {
            name: "smollm2",
            layers: 30,
            params: params(9, 3),
        },
        Shape {
            name: "qwen2.5-0.5b",
            layers: 24,
            params: params(14, 2),
        },
    ]
}

/// `seqs × layers` caches of `ctx` tokens each.
fn filled(be: &CandleBackend, s: &Shape, seqs: usize, ctx: usize) -> Vec<Vec<CpuKvLayer>> {
    let p = &s.params;
    let (q_w, kv_w) = (p.heads * p.head_dim, p.kv_heads * p.head_dim);
    (0..s.layers)
        .map(|l| {
            (0..seqs)
                .map(|i| {
                    let mut cache = be.new_kv_layer(p.kv_heads, p.head_dim, None);
                    let seed = (l * 64 + i) as u64;
                    let q = HostTensor::from_vec(noise(seed, ctx * q_w), ctx, q_w).unwrap();
                    let k = HostTensor::from_vec(noise(seed + 1, ctx * kv_w), ctx, kv_w).unwrap();
                    let v = HostTensor::from_vec(noise(seed + 2, ctx * kv_w), ctx, kv_w).unwrap();
                    let mut seg = [AttentionSegment {
                        rows: 0..ctx,
                        cache: &mut cache,
                    }];
                    be.attention(&q, &k, &v, &mut seg, p).unwrap();
                    cache
                })
                .collect()
        })
        .collect()
}

/// One step: every layer's attention for `rows_each` new rows of every sequence, then the
/// caches are cut back (cheap: their blocks are not shared), so every iteration sees the
/// same context.
fn step(be: &CandleBackend, s: &Shape, caches: &mut [Vec<CpuKvLayer>], rows_each: usize) {
    let p = &s.params;
    let (q_w, kv_w) = (p.heads * p.head_dim, p.kv_heads * p.head_dim);
    let seqs = caches[0].len();
    let n = seqs * rows_each;
    let q = HostTensor::from_vec(noise(7, n * q_w), n, q_w).unwrap();
    let k = HostTensor::from_vec(noise(8, n * kv_w), n, kv_w).unwrap();
    let v = HostTensor::from_vec(noise(9, n * kv_w), n, kv_w).unwrap();
    for layer in caches.iter_mut() {
        let mut segs: Vec<AttentionSegment<'_, CpuKvLayer>> = layer
            .iter_mut()
            .enumerate()
            .map(|(i, cache)| AttentionSegment {
                rows: i * rows_each..(i + 1) * rows_each,
                cache,
            })
            .collect();
        black_box(be.attention(&q, &k, &v, &mut segs, p).unwrap());
        for cache in layer.iter_mut() {
            cache.trim(cache.len() - rows_each).unwrap();
        }
    }
}

fn bench_attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention_decode_step");
    g.sample_size(20);
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let be = CandleBackend::cpu().with_kv_dtype(dtype);
        for s in shapes() {
            for seqs in [1usize, 8] {
                let mut caches = filled(&be, &s, seqs, 300);
                g.throughput(Throughput::Elements(seqs as u64));
                let id = format!("{}/{seqs}x300", dtype.name());
                g.bench_function(BenchmarkId::new(s.name, id), |b| {
                    b.iter(|| step(&be, &s, &mut caches, 1))
                });
            }
        }
    }
    g.finish();
    let be = CandleBackend::cpu();
    let mut g = c.benchmark_group("attention_prefill_chunk");
    g.sample_size(10);
    let s = &shapes()[0];
    let one_layer = Shape {
        name: s.name,
        layers: 1,
        params: s.params.clone(),
    };
    let mut caches = filled(&be, &one_layer, 1, 512);
    g.throughput(Throughput::Elements(512));
    g.bench_function(BenchmarkId::new(s.name, "512 after 512"), |b| {
        b.iter(|| step(&be, &one_layer, &mut caches, 512))
    });
    g.finish();
}

criterion_group!(benches, bench_attention);
criterion_main!(benches);
