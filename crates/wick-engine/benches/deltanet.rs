//! Qwen 3.5's gated DeltaNet mixer over a 2048-token prompt, one linear-attention layer of a
//! Qwen3.5-4B-like shape (16 key heads and 32 value heads of 128 dims, kernel 4): the chunked
//! form the model prefills with, against feeding the same prompt through the per-token
//! recurrence. Both include the convolution, gating and gated norm around the delta rule.
//!
//! With `--features mlx`, the mixer on the MLX backend (its default device) as MLX ops
//! (`Backend::delta_net`) against the trait's host default on the same backend (each
//! segment's rows copied to the host, mixed there, the result uploaded): a decode step of 8
//! sequences and a 512-token prompt.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use wick_engine::models::deltanet::{
    chunked, conv1d_silu, mix, recurrent, DeltaParams, DeltaShape, DeltaState, Form, HeadInputs,
};

fn noise(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let shape = DeltaShape {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
        conv_kernel: 4,
    };
    let n = 2048;
    let (cd, vd) = (shape.conv_dim(), shape.v_heads * shape.v_dim);
    let qkv = noise(1, n * cd, 1.0);
    let z = noise(2, n * vd, 1.0);
    let b = noise(3, n * shape.v_heads, 1.0);
    let a = noise(4, n * shape.v_heads, 1.0);
    let conv = noise(5, cd * shape.conv_kernel, 0.5);
    let neg_a: Vec<f32> = noise(6, shape.v_heads, 0.5)
        .iter()
        .map(|x| -(x.exp()))
        .collect();
    let dt_bias = noise(7, shape.v_heads, 0.5);
    let norm = vec![1.0; shape.v_dim];
    let p = DeltaParams {
        shape,
        conv: &conv,
        neg_a: &neg_a,
        dt_bias: &dt_bias,
        norm: &norm,
        eps: 1e-6,
    };
    let mut g = c.benchmark_group("deltanet_prefill_2048");
    g.sample_size(10);
    g.throughput(Throughput::Elements(n as u64));
    for (name, form) in [("chunked", Form::Auto), ("per_token", Form::Recurrent)] {
        g.bench_with_input(BenchmarkId::from_parameter(name), &form, |bench, &form| {
            bench.iter(|| {
                let mut state = DeltaState::new(&shape);
                black_box(mix(&p, &qkv, &z, &b, &a, &mut state, form).unwrap())
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("conv_2048");
    g.sample_size(10);
    g.bench_function("conv1d_silu", |b| {
        b.iter(|| {
            let mut st = vec![0.0; shape.conv_state_len()];
            black_box(conv1d_silu(&qkv, cd, &conv, shape.conv_kernel, &mut st).unwrap())
        })
    });
    g.finish();

    // The delta rule alone, one value head (what the two forms differ in).
    let (kd, vd) = (shape.k_dim, shape.v_dim);
    let unit = |seed, rows: usize, dim: usize| -> Vec<f32> {
        let mut x = noise(seed, rows * dim, 1.0);
        for r in x.chunks_exact_mut(dim) {
            let inv = 1.0 / r.iter().map(|v| v * v).sum::<f32>().sqrt();
            r.iter_mut().for_each(|v| *v *= inv);
        }
        x
    };
    let (q, k) = (unit(11, n, kd), unit(12, n, kd));
    let v = noise(13, n * vd, 1.0);
    let gate: Vec<f32> = noise(14, n, 0.5).iter().map(|x| -(x + 0.6) * 0.2).collect();
    let beta: Vec<f32> = noise(15, n, 0.4).iter().map(|x| x + 0.5).collect();
    let inputs = HeadInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &gate,
        beta: &beta,
    };
    let mut g = c.benchmark_group("delta_rule_one_head_2048");
    g.sample_size(10);
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function("chunked", |b| {
        b.iter(|| black_box(chunked(&inputs, kd, vd, &mut vec![0.0; kd * vd])))
    });
    g.bench_function("per_token", |b| {
        b.iter(|| black_box(recurrent(&inputs, kd, vd, &mut vec![0.0; kd * vd])))
    });
    g.finish();
}

/// [`Backend::delta_net`] on MLX against the host default, both read back to the host.
#[cfg(feature = "mlx")]
fn bench_mlx(c: &mut Criterion) {
    use wick_engine::backend::mlx::{DeltaNetPlace, Dtype, MlxBackend};
    use wick_engine::backend::{Backend, DeltaInputs, DeltaSegment};

    let be = MlxBackend::new(MlxBackend::default_device(), Dtype::F32)
        .unwrap()
        .with_deltanet(DeltaNetPlace::Device);
    let shape = DeltaShape {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
        conv_kernel: 4,
    };
    let (cd, vd, vh) = (shape.conv_dim(), shape.v_heads * shape.v_dim, shape.v_heads);
    let conv = noise(5, cd * shape.conv_kernel, 0.5);
    let neg_a: Vec<f32> = noise(6, vh, 0.5).iter().map(|x| -(x.exp())).collect();
    let dt_bias = noise(7, vh, 0.5);
    let norm = vec![1.0; shape.v_dim];
    let p = DeltaParams {
        shape,
        conv: &conv,
        neg_a: &neg_a,
        dt_bias: &dt_bias,
        norm: &norm,
        eps: 1e-6,
    };
    let uploaded = be.delta_weights(&p).unwrap();
    for (group, seqs, rows) in [
        ("mlx_deltanet_decode_8", 8, 1),
        ("mlx_deltanet_prefill_512", 1, 512),
    ] {
        let n = seqs * rows;
        let host = [
            noise(1, n * cd, 1.0),
            noise(2, n * vd, 1.0),
            noise(3, n * vh, 1.0),
            noise(4, n * vh, 1.0),
        ];
        let t = |i: usize, cols: usize| be.tensor_from_host(host[i].clone(), n, cols).unwrap();
        let (qkv, z, b, a) = (t(0, cd), t(1, vd), t(2, vh), t(3, vh));
        let inputs = || DeltaInputs {
            qkv: &qkv,
            z: &z,
            b: &b,
            a: &a,
        };
        let mut g = c.benchmark_group(group);
        g.sample_size(10);
        g.throughput(Throughput::Elements(n as u64));
        let mut states: Vec<_> = (0..seqs).map(|_| be.new_delta_state(&shape)).collect();
        g.bench_function("mlx_ops", |bench| {
            bench.iter(|| {
                let mut segments: Vec<DeltaSegment<'_, _>> = states
                    .iter_mut()
                    .enumerate()
                    .map(|(i, state)| DeltaSegment {
                        rows: i * rows..(i + 1) * rows,
                        state,
                    })
                    .collect();
                let out = be
                    .delta_net(&p, uploaded.as_ref(), inputs(), &mut segments)
                    .unwrap();
                black_box(be.rows_to_host(&out, &[n]).unwrap())
            })
        });
        let mut states: Vec<DeltaState> = (0..seqs).map(|_| DeltaState::new(&shape)).collect();
        g.bench_function("host_default", |bench| {
            bench.iter(|| {
                // What `Backend::delta_net`'s default does on a backend with host states.
                let counts = vec![rows; seqs];
                let part = |x: &_| be.rows_to_host(x, &counts).unwrap();
                let (q, zz, bb, aa) = (part(&qkv), part(&z), part(&b), part(&a));
                let mut mixed = Vec::with_capacity(n * vd);
                for (i, st) in states.iter_mut().enumerate() {
                    mixed.extend(mix(&p, &q[i], &zz[i], &bb[i], &aa[i], st, Form::Auto).unwrap());
                }
                let out = be.tensor_from_host(mixed, n, vd).unwrap();
                black_box(be.rows_to_host(&out, &[n]).unwrap())
            })
        });
        g.finish();
    }
}

#[cfg(not(feature = "mlx"))]
fn bench_mlx(_: &mut Criterion) {}

criterion_group!(benches, bench, bench_mlx);
criterion_main!(benches);
