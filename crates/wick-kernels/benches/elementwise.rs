//! Row-wise and elementwise ops at decode (one row) and prompt (512 rows) sizes, on one
//! thread, timed in thread CPU time (see `support/cpu_time.rs`).
#[path = "support/cpu_time.rs"]
mod cpu_time;

use cpu_time::ThreadCpuTime;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use wick_kernels::elementwise::{self, GluActivation};
use wick_kernels::{Isa, ThreadPool};

fn ops(c: &mut Criterion<ThreadCpuTime>) {
    let pool = &ThreadPool::new(1);
    let isa = Isa::best();
    for (name, rows, dim) in [("decode", 1usize, 4864usize), ("prompt", 512, 4864)] {
        let n = rows * dim;
        let x: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 0.05).collect();
        let y: Vec<f32> = (0..n).map(|i| ((i % 89) as f32 - 44.0) * 0.03).collect();
        let w: Vec<f32> = (0..dim).map(|i| 1.0 + (i % 7) as f32 * 0.01).collect();
        let mut out = vec![0f32; n];
        let mut group = c.benchmark_group(format!("elementwise/{name}"));
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(BenchmarkId::new("rms_norm", dim), |b| {
            b.iter(|| elementwise::rms_norm(pool, isa, &x, &w, 1e-6, &mut out).expect("rms_norm"))
        });
        for act in [GluActivation::Silu, GluActivation::GeluTanh] {
            group.bench_function(BenchmarkId::new(format!("glu_{act:?}"), dim), |b| {
                b.iter(|| elementwise::glu(pool, isa, act, &x, &y, &mut out).expect("glu"))
            });
        }
        group.bench_function(BenchmarkId::new("add", dim), |b| {
            b.iter(|| elementwise::add(isa, &x, &y, &mut out).expect("add"))
        });
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpuTime);
    targets = ops
}
criterion_main!(benches);
