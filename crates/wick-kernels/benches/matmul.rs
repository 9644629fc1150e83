//! Quantized and float products at the shapes of the models wick runs: one token (decode),
//! 2, 4 and 8 tokens (batched decode) and a 128-token prompt chunk (compute-bound), on one
//! thread, timed in thread CPU time (see `support/cpu_time.rs`). Throughput is
//! multiply-adds per second.
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
    targets = products
}
criterion_main!(benches);
