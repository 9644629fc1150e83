//! The shim against hand-computed results, on MLX's CPU device (needs `--features runtime`).
#![cfg(feature = "runtime")]
use wick_mlx::{eval, Array, AttentionMask, Device, Dtype, GluActivation, RopeOffset, Stream};

fn cpu() -> Stream {
    Stream::new(Device::Cpu).expect("MLX CPU stream")
}

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn matmul_and_shapes() {
    let s = cpu();
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    assert_eq!(a.shape(), vec![2, 3]);
    assert_eq!(a.dtype(), Dtype::F32);
    let at = s.transpose(&a, &[1, 0]).unwrap();
    let p = s.matmul(&a, &at).unwrap();
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![14.0, 32.0, 32.0, 77.0]);
    let sl = s.slice(&a, &[0, 1], &[2, 3]).unwrap();
    assert_eq!(sl.to_vec::<f32>().unwrap(), vec![2.0, 3.0, 5.0, 6.0]);
    let z = s.zeros(&[2, 3], Dtype::F32).unwrap();
    let upd = Array::from_slice(&[9.0f32, 9.0], &[2, 1]).unwrap();
    let z = s.slice_update(&z, &upd, &[0, 2], &[2, 3]).unwrap();
    assert_eq!(
        z.to_vec::<f32>().unwrap(),
        vec![0.0, 0.0, 9.0, 0.0, 0.0, 9.0]
    );
    let idx = Array::from_slice(&[1u32, 0, 1], &[3]).unwrap();
    let rows = s.take(&a, &idx, 0).unwrap();
    assert_eq!(rows.shape(), vec![3, 3]);
    assert_eq!(
        s.argmax(&rows, 1).unwrap().to_vec::<u32>().unwrap(),
        vec![2, 2, 2]
    );
    // Wrong dtype reads and wrong byte counts are errors, not crashes.
    assert!(p.to_vec::<u32>().is_err());
    assert!(Array::from_bytes(&[0u8; 5], &[2], Dtype::F32).is_err());
    assert!(s.matmul(&a, &a).is_err());
}

#[test]
fn glu_matches_its_formula() {
    let s = cpu();
    let g = values(64, 1);
    let u = values(64, 2);
    let ga = Array::from_slice(&g, &[4, 16]).unwrap();
    let ua = Array::from_slice(&u, &[4, 16]).unwrap();
    let silu = s
        .glu(&ga, &ua, GluActivation::Silu)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let want: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&x, &y)| x / (1.0 + (-x).exp()) * y)
        .collect();
    assert!(max_diff(&silu, &want) < 1e-6);
    let gelu = s
        .glu(&ga, &ua, GluActivation::GeluTanh)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let want: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&x, &y)| {
            0.5 * x
                * (1.0 + ((2.0 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
                * y
        })
        .collect();
    assert!(max_diff(&gelu, &want) < 1e-6);
}

#[test]
fn activation_and_layer_norm_match_their_formulas() {
    let s = cpu();
    let x = values(96, 4);
    let xa = Array::from_slice(&x, &[4, 24]).unwrap();
    let got = |a: Array| a.to_vec::<f32>().unwrap();
    let silu = got(s.activation(&xa, GluActivation::Silu).unwrap());
    let want: Vec<f32> = x.iter().map(|&v| v / (1.0 + (-v).exp())).collect();
    assert!(max_diff(&silu, &want) < 1e-6);
    let gelu = got(s.activation(&xa, GluActivation::GeluTanh).unwrap());
    let c = (2.0 / std::f32::consts::PI).sqrt();
    let want: Vec<f32> = x
        .iter()
        .map(|&v| 0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh()))
        .collect();
    assert!(max_diff(&gelu, &want) < 1e-6);

    let (w, b) = (values(24, 5), values(24, 6));
    let wa = Array::from_slice(&w, &[24]).unwrap();
    let ba = Array::from_slice(&b, &[24]).unwrap();
    let eps = 1e-5;
    let normed = |with_bias: bool| -> Vec<f32> {
        x.chunks(24)
            .flat_map(|row| {
                let mean = row.iter().sum::<f32>() / 24.0;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / 24.0;
                let inv = 1.0 / (var + eps).sqrt();
                row.iter()
                    .enumerate()
                    .map(|(i, v)| (v - mean) * inv * w[i] + if with_bias { b[i] } else { 0.0 })
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let with_bias = got(s.layer_norm(&xa, Some(&wa), Some(&ba), eps).unwrap());
    assert!(max_diff(&with_bias, &normed(true)) < 1e-5);
    let without = got(s.layer_norm(&xa, Some(&wa), None, eps).unwrap());
    assert!(max_diff(&without, &normed(false)) < 1e-5);
}

#[test]
fn quantized_matmul_matches_dequantized_product() {
    let s = cpu();
    let (out, inp) = (8, 128);
    let w = Array::from_slice(&values(out * inp, 3), &[out as i32, inp as i32]).unwrap();
    let x = Array::from_slice(&values(3 * inp, 4), &[3, inp as i32]).unwrap();
    for (gs, bits) in [(32, 4), (64, 4), (32, 8), (64, 8)] {
        let q = s.quantize(&w, gs, bits).unwrap();
        assert_eq!(
            q.weight.shape(),
            vec![out as i32, (inp * bits as usize / 32) as i32]
        );
        let dq = s.dequantize(&q).unwrap();
        let wt = s.transpose(&dq, &[1, 0]).unwrap();
        let dense = s.matmul(&x, &wt).unwrap().to_vec::<f32>().unwrap();
        let fused = s.quantized_matmul(&x, &q).unwrap().to_vec::<f32>().unwrap();
        assert!(max_diff(&dense, &fused) < 1e-4, "gs {gs} bits {bits}");
        // The quantization itself is close to the original.
        let err = max_diff(&dq.to_vec::<f32>().unwrap(), &w.to_vec::<f32>().unwrap());
        assert!(
            err < if bits == 4 { 0.15 } else { 0.01 },
            "bits {bits}: {err}"
        );
    }
}

#[test]
fn rope_matches_rotation_of_halves() {
    let s = cpu();
    let (h, l, d) = (2usize, 3usize, 8usize);
    let x = values(h * l * d, 5);
    let xa = Array::from_slice(&x, &[1, h as i32, l as i32, d as i32]).unwrap();
    let inv: Vec<f32> = (0..d / 2)
        .map(|i| 10000f32.powf(-(2.0 * i as f32) / d as f32))
        .collect();
    let periods: Vec<f32> = inv.iter().map(|f| 1.0 / f).collect();
    let freqs = Array::from_slice(&periods, &[(d / 2) as i32]).unwrap();
    let got = s
        .rope(
            &xa,
            d as i32,
            false,
            0.0,
            1.0,
            RopeOffset::Fixed(4),
            Some(&freqs),
        )
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let mut want = x.clone();
    for hh in 0..h {
        for ll in 0..l {
            let base = (hh * l + ll) * d;
            for i in 0..d / 2 {
                let ang = (4 + ll) as f32 * inv[i];
                let (a, b) = (x[base + i], x[base + i + d / 2]);
                want[base + i] = a * ang.cos() - b * ang.sin();
                want[base + i + d / 2] = a * ang.sin() + b * ang.cos();
            }
        }
    }
    assert!(max_diff(&got, &want) < 1e-5);
    // Per-batch offsets equal separate fixed offsets.
    let xb = Array::from_slice(&values(2 * d, 6), &[2, 1, 1, d as i32]).unwrap();
    let offs = Array::from_slice(&[3i32, 11], &[2]).unwrap();
    let both = s
        .rope(
            &xb,
            d as i32,
            true,
            10000.0,
            1.0,
            RopeOffset::PerBatch(&offs),
            None,
        )
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    for (b, off) in [(0, 3), (1, 11)] {
        let one = s
            .slice(&xb, &[b, 0, 0, 0], &[b + 1, 1, 1, d as i32])
            .unwrap();
        let r = s
            .rope(
                &one,
                d as i32,
                true,
                10000.0,
                1.0,
                RopeOffset::Fixed(off),
                None,
            )
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert!(max_diff(&r, &both[b as usize * d..(b as usize + 1) * d]) < 1e-6);
    }
}

#[test]
fn sdpa_matches_softmax_attention() {
    let s = cpu();
    let (h, hk, l, n, d) = (4usize, 2usize, 3usize, 5usize, 16usize);
    let q = values(h * l * d, 7);
    let k = values(hk * n * d, 8);
    let v = values(hk * n * d, 9);
    let qa = Array::from_slice(&q, &[1, h as i32, l as i32, d as i32]).unwrap();
    let ka = Array::from_slice(&k, &[1, hk as i32, n as i32, d as i32]).unwrap();
    let va = Array::from_slice(&v, &[1, hk as i32, n as i32, d as i32]).unwrap();
    let scale = 0.25;
    let got = s
        .sdpa(&qa, &ka, &va, scale, AttentionMask::Causal)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let mut want = vec![0f32; h * l * d];
    for hh in 0..h {
        let kh = hh / (h / hk);
        for i in 0..l {
            let visible = n - l + i + 1;
            let scores: Vec<f32> = (0..visible)
                .map(|j| {
                    (0..d)
                        .map(|e| q[(hh * l + i) * d + e] * k[(kh * n + j) * d + e])
                        .sum::<f32>()
                        * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::MIN, f32::max);
            let w: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f32 = w.iter().sum();
            for e in 0..d {
                want[(hh * l + i) * d + e] = (0..visible)
                    .map(|j| w[j] / z * v[(kh * n + j) * d + e])
                    .sum();
            }
        }
    }
    assert!(max_diff(&got, &want) < 1e-5);
    // An explicit boolean mask equal to the causal one gives the same result.
    let mask: Vec<u8> = (0..l * n)
        .map(|ij| ((ij % n) <= n - l + ij / n) as u8)
        .collect();
    let m = Array::from_bytes(&mask, &[l as i32, n as i32], Dtype::Bool).unwrap();
    let masked = s
        .sdpa(&qa, &ka, &va, scale, AttentionMask::Array(&m))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert!(max_diff(&masked, &want) < 1e-5);
    eval(&[&qa]).unwrap();
}

#[test]
fn arrays_cross_threads() {
    let s = cpu();
    let a = Array::from_slice(&values(256, 10), &[16, 16]).unwrap();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let a = a.clone();
            std::thread::spawn(move || {
                let p = s.matmul(&a, &a).unwrap();
                p.to_vec::<f32>().unwrap()
            })
        })
        .collect();
    let results: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(results.windows(2).all(|w| w[0] == w[1]));
}
