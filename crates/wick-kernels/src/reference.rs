//! Slow, obviously-correct products in f64, for tests and benches to check the kernels
//! against.
use crate::{ggml, QuantizedActivations, Result, WeightFormat};

/// `x · wᵀ` in f64 with `w` dequantized by [`ggml::dequantize_row`] from its file bytes.
///
/// For quantized formats pass the quantized activations (`act`): the kernels multiply
/// the dequantized weights with exactly those values (`d · q` per block), so the only
/// difference left is f32 rounding. For float formats `act` is ignored and `x` is used.
pub fn matmul(
    format: WeightFormat,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    x: &[f32],
    n: usize,
    act: Option<&QuantizedActivations>,
) -> Result<Vec<f64>> {
    let row_bytes = format.row_bytes(cols)?;
    let mut w = vec![0f32; cols];
    let mut out = vec![0f64; n * rows];
    let inputs: Vec<Vec<f64>> = (0..n)
        .map(|t| match act {
            Some(a) if format.is_quantized() => (0..cols)
                .map(|c| a.scale(t, c / 32) as f64 * a.row(t)[c] as f64)
                .collect(),
            _ => x[t * cols..(t + 1) * cols]
                .iter()
                .map(|&v| v as f64)
                .collect(),
        })
        .collect();
    for r in 0..rows {
        ggml::dequantize_row(format, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut w)?;
        for (t, xin) in inputs.iter().enumerate() {
            out[t * rows + r] = w.iter().zip(xin).map(|(&a, &b)| a as f64 * b).sum();
        }
    }
    Ok(out)
}
