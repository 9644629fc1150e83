//! LayerNorm and ungated activations on host memory (StarCoder 2's layers), computed
//! in f64 per row so that they agree with PyTorch's f32 kernels to rounding.
use crate::backend::Activation;

/// `(x - mean) / sqrt(var + eps) * weight (+ bias)` over every `weight.len()` values.
pub(crate) fn layer_norm(
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    eps: f32,
    out: &mut [f32],
) {
    let n = weight.len();
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n as f64;
        let inv = 1.0 / (var + f64::from(eps)).sqrt();
        for (i, (o, &v)) in o.iter_mut().zip(row).enumerate() {
            let b = bias.map_or(0.0, |b| f64::from(b[i]));
            *o = ((f64::from(v) - mean) * inv * f64::from(weight[i]) + b) as f32;
        }
    }
}

/// `act(x)` elementwise.
pub(crate) fn activation(x: &[f32], act: Activation, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        let v = f64::from(v);
        *o = match act {
            Activation::Silu => v / (1.0 + (-v).exp()),
            Activation::GeluTanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())
            }
        } as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_centres_and_scales_each_group() {
        let x = [1.0, 2.0, 3.0, 4.0, -1.0, -1.0, 1.0, 1.0];
        let mut out = [0.0; 8];
        layer_norm(
            &x,
            &[1.0, 1.0, 2.0, 2.0],
            Some(&[0.0, 0.5, 0.0, 0.0]),
            0.0,
            &mut out,
        );
        let s = 1.0 / 1.25f32.sqrt();
        let want = [
            -1.5 * s,
            -0.5 * s + 0.5,
            1.0 * s,
            3.0 * s,
            -1.0,
            -0.5,
            2.0,
            2.0,
        ];
        for (g, w) in out.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{out:?}");
        }
    }

    #[test]
    fn gelu_tanh_matches_known_values() {
        let mut out = [0.0; 3];
        activation(&[0.0, 1.0, -2.0], Activation::GeluTanh, &mut out);
        for (g, w) in out.iter().zip([0.0, 0.841_192, -0.045_402_3]) {
            assert!((g - w).abs() < 1e-5, "{out:?}");
        }
    }
}
