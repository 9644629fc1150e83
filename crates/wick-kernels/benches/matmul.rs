//! Quantized and float products at the shapes of the models wick runs: one token (decode),
//! 2, 4 and 8 tokens (batched decode) and a 128-token prompt chunk (compute-bound), on one
//! thread, timed in thread CPU time (see `support/cpu_time.rs`). Throughput is
//! multiply-adds per second.
//!
//! The `decode/…` groups are every matrix of one SmolLM2-135M layer (and its output head)
//! at 1–16 tokens: batched decode should cost little more than one token, since the
//! weights stream once either way. `cargo bench --bench matmul -- decode/` runs only them.
#[path = "support/cpu_time.rs"]
mod cpu_time;

use cpu_time::ThreadCpuTime;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use wick_kernels::{
    matmul, Isa, PackedMatrix, Product, QuantizedActivations, ThreadPool, WeightFormat,
};

fn matrix(format: WeightFormat, rows: usize, cols: usize) -> PackedMatrix {
    let row_bytes = format.row_bytes(cols).expect("shape");
    let mut s = 0x2545_F491u32;
    let mut bytes: Vec<u8> = (0..rows * row_bytes)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s as u8
        })
        .collect();
    // Keep every scale a small finite f16 (0x2000 ≈ 0.0078).
    for b in bytes.chunks_exact_mut(format.block_bytes()) {
        match format {
            WeightFormat::Q6K => b[208..210].copy_from_slice(&[0, 0x20]),
            WeightFormat::F32 => b.copy_from_slice(&0.01f32.to_le_bytes()),
            WeightFormat::F16 | WeightFormat::Bf16 => b.copy_from_slice(&[0, 0x20]),
            _ => {
                b[0..2].copy_from_slice(&[0, 0x20]);
                b[2..4].copy_from_slice(&[0, 0x20]);
            }
        }
    }
    PackedMatrix::from_ggml(format, rows, cols, &bytes).expect("pack")
}

/// Times one product of `w` with `n` tokens.
fn bench_product(
    group: &mut criterion::BenchmarkGroup<'_, ThreadCpuTime>,
    pool: &ThreadPool,
    w: &PackedMatrix,
    n: usize,
) {
    let (rows, cols) = (w.rows(), w.cols());
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i % 17) as f32 - 8.0) * 0.1)
        .collect();
    let mut out = vec![0f32; n * rows];
    let mut act = QuantizedActivations::new();
    group.throughput(Throughput::Elements((n * rows * cols) as u64));
    group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
        b.iter(|| {
            matmul(
                pool,
                Isa::best(),
                &x,
                n,
                &mut [Product {
                    weight: w,
                    out: &mut out,
                    bias: None,
                }],
                &mut act,
            )
            .expect("matmul")
        })
    });
}

/// SmolLM2-135M's matrices (and a k-quant/Q8_0/Q5_0 layer of the other default models)
/// at the token counts of batched decode.
fn decode(c: &mut Criterion<ThreadCpuTime>) {
    let pool = &ThreadPool::new(1);
    let shapes = [
        ("q_o", WeightFormat::Q4_1, 576, 576),
        ("k_v", WeightFormat::Q4_1, 192, 576),
        ("gate_up", WeightFormat::Q4_1, 1536, 576),
        ("down", WeightFormat::Q4_1, 576, 1536),
        ("head", WeightFormat::Q4_1, 49_152, 576),
        ("q4k", WeightFormat::Q4K, 896, 4864),
        ("q6k", WeightFormat::Q6K, 896, 4864),
        ("q8_0", WeightFormat::Q8_0, 896, 896),
        ("q5_0", WeightFormat::Q5_0, 4864, 896),
    ];
    for (name, format, rows, cols) in shapes {
        let w = matrix(format, rows, cols);
        let mut group = c.benchmark_group(format!("decode/{name}"));
        group.sample_size(10);
        group.warm_up_time(std::time::Duration::from_millis(300));
        group.measurement_time(std::time::Duration::from_secs(1));
        for n in [1usize, 2, 4, 8, 16] {
            bench_product(&mut group, pool, &w, n);
        }
        group.finish();
    }
}

/// Every product of one SmolLM2-135M decode step (30 layers of q/k/v, o, gate/up and
/// down, then the output head; ~85 MB of Q4_1, more than the last-level cache), so the
/// weights stream from memory as in the engine.
fn decode_step(c: &mut Criterion<ThreadCpuTime>) {
    let pool = &ThreadPool::new(1);
    let (d, kv, ff) = (576, 192, 1536);
    let q4 = WeightFormat::Q4_1;
    // One call per shared input, as the engine issues them.
    let mut calls: Vec<Vec<PackedMatrix>> = Vec::new();
    for _ in 0..30 {
        calls.push(vec![matrix(q4, d, d), matrix(q4, kv, d), matrix(q4, kv, d)]);
        calls.push(vec![matrix(q4, d, d)]);
        calls.push(vec![matrix(q4, ff, d), matrix(q4, ff, d)]);
        calls.push(vec![matrix(q4, d, ff)]);
    }
    calls.push(vec![matrix(q4, 49_152, d)]);
    let mut group = c.benchmark_group("decode/step");
    group.sample_size(10);
    group.warm_up_time(std::time::Duration::from_millis(500));
    group.measurement_time(std::time::Duration::from_secs(2));
    for n in [1usize, 2, 4, 8, 16] {
        let mut act = QuantizedActivations::new();
        let mut outs: Vec<Vec<Vec<f32>>> = calls
            .iter()
            .map(|ms| ms.iter().map(|m| vec![0f32; n * m.rows()]).collect())
            .collect();
        let inputs: Vec<Vec<f32>> = [d, ff]
            .iter()
            .map(|&cols| {
                (0..n * cols)
                    .map(|i| ((i % 17) as f32 - 8.0) * 0.1)
                    .collect()
            })
            .collect();
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter(|| {
                for (ms, os) in calls.iter().zip(outs.iter_mut()) {
                    let x = if ms[0].cols() == d {
                        &inputs[0]
                    } else {
                        &inputs[1]
                    };
                    let mut products: Vec<Product<'_>> = ms
                        .iter()
                        .zip(os.iter_mut())
                        .map(|(w, o)| Product {
                            weight: w,
                            out: o,
                            bias: None,
                        })
                        .collect();
                    matmul(pool, Isa::best(), x, n, &mut products, &mut act).expect("matmul");
                }
            })
        });
    }
    group.finish();
}

fn products(c: &mut Criterion<ThreadCpuTime>) {
    let pool = &ThreadPool::new(1);
    let isa = Isa::best();
    let shapes = [
        ("smollm2.ffn_up", WeightFormat::Q4_1, 1536, 576),
        ("qwen2.ffn_up", WeightFormat::Q5_0, 4864, 896),
        ("qwen2.ffn_down.q6k", WeightFormat::Q6K, 896, 4864),
        ("qwen2.ffn_down.q4k", WeightFormat::Q4K, 896, 4864),
        ("qwen2.output", WeightFormat::Q8_0, 151_936, 896),
        ("f16", WeightFormat::F16, 1536, 576),
    ];
    for (name, format, rows, cols) in shapes {
        let w = matrix(format, rows, cols);
        let mut group = c.benchmark_group(format!("matmul/{name}"));
        group.sample_size(10);
        for n in [1usize, 2, 4, 8, 128] {
            if rows > 100_000 && n > 8 {
                continue;
            }
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i % 17) as f32 - 8.0) * 0.1)
                .collect();
            let mut out = vec![0f32; n * rows];
            let mut act = QuantizedActivations::new();
            group.throughput(Throughput::Elements((n * rows * cols) as u64));
            group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
                b.iter(|| {
                    matmul(
                        pool,
                        isa,
                        &x,
                        n,
                        &mut [Product {
                            weight: &w,
                            out: &mut out,
                            bias: None,
                        }],
                        &mut act,
                    )
                    .expect("matmul")
                })
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpuTime);
    targets = products, decode, decode_step
}
criterion_main!(benches);
