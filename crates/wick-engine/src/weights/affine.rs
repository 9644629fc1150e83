//! MLX's affine quantized layout on the host: `w ≈ scale · q + bias` per group of
//! `group_size` consecutive inputs of a row, the `bits`-wide `q` values packed as a
//! little-endian bit stream into `u32` words (the mlx-community checkpoint layout:
//! `<name>.weight` (U32) + `<name>.scales` + `<name>.biases`).
//!
//! Also the lossless re-layout of GGUF block types whose blocks are exactly affine groups
//! of 32 (`Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q4_K`, `Q5_K`) into this layout, with
//! f32 scales and biases, so MLX's quantized matmul runs GGUF files without dequantizing.
use std::borrow::Cow;

use half::f16;
use wick_gguf::GgmlType;

use super::HostWeight;
use crate::{EngineError, Result};

/// A matrix in MLX's affine layout, as read from a file (or re-laid out from GGUF).
#[derive(Debug, Clone)]
pub struct AffineWeight<'a> {
    /// Name as the file spells it (for errors and logs).
    pub name: String,
    /// Output rows.
    pub rows: usize,
    /// Input columns (unpacked).
    pub cols: usize,
    /// Bits per value: 2, 3, 4, 5, 6 or 8.
    pub bits: u32,
    /// Values per group (32, 64 or 128).
    pub group_size: usize,
    /// Packed values, `rows × cols · bits / 8` bytes (little-endian `u32` words).
    pub packed: Cow<'a, [u8]>,
    /// Scales `[rows, cols / group_size]` (F32, F16 or BF16).
    pub scales: HostWeight<'a>,
    /// Biases, same shape and type as the scales.
    pub biases: HostWeight<'a>,
}

fn bad(name: &str, reason: impl Into<String>) -> EngineError {
    EngineError::Config {
        source_name: name.to_string(),
        reason: reason.into(),
    }
}

impl AffineWeight<'_> {
    /// Checks that the pieces fit together: supported bits and group size, packed bytes
    /// and scale/bias shapes that match `rows × cols`.
    pub fn validate(&self) -> Result<()> {
        let name = &self.name;
        if ![2, 3, 4, 5, 6, 8].contains(&self.bits) {
            return Err(bad(
                name,
                format!("unsupported {}-bit quantization", self.bits),
            ));
        }
        if ![32, 64, 128].contains(&self.group_size) {
            return Err(bad(
                name,
                format!("unsupported group size {}", self.group_size),
            ));
        }
        if !self.cols.is_multiple_of(self.group_size)
            || !(self.cols * self.bits as usize).is_multiple_of(32)
        {
            return Err(bad(
                name,
                format!(
                    "{} columns do not split into groups of {} / whole words",
                    self.cols, self.group_size
                ),
            ));
        }
        let want = self.rows * self.cols * self.bits as usize / 8;
        if self.packed.len() != want {
            return Err(bad(
                name,
                format!(
                    "packed weight has {} bytes, {} expected for {}×{} at {} bits",
                    self.packed.len(),
                    want,
                    self.rows,
                    self.cols,
                    self.bits
                ),
            ));
        }
        let groups = [self.rows, self.cols / self.group_size];
        for (what, w) in [("scales", &self.scales), ("biases", &self.biases)] {
            if w.shape != groups {
                return Err(bad(
                    name,
                    format!("{what} have shape {:?}, expected {groups:?}", w.shape),
                ));
            }
            if !matches!(w.dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16) {
                return Err(bad(
                    name,
                    format!("{what} are {}, not a float type", w.dtype),
                ));
            }
        }
        Ok(())
    }

    /// The quantized values of row `r`, unpacked.
    fn row_values(&self, r: usize) -> Vec<u32> {
        let bits = self.bits as usize;
        let row_bytes = self.cols * bits / 8;
        let row = &self.packed[r * row_bytes..(r + 1) * row_bytes];
        let mask = (1u32 << bits) - 1;
        (0..self.cols)
            .map(|i| {
                let bit = i * bits;
                let (byte, shift) = (bit / 8, bit % 8);
                let mut v = row[byte] as u32;
                if byte + 1 < row.len() {
                    v |= (row[byte + 1] as u32) << 8;
                }
                (v >> shift) & mask
            })
            .collect()
    }

    /// The float matrix `[rows, cols]` this stands for, row-major.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        self.validate()?;
        let scales = self.scales.float_values("affine weight")?;
        let biases = self.biases.float_values("affine weight")?;
        let groups = self.cols / self.group_size;
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            for (i, q) in self.row_values(r).into_iter().enumerate() {
                let g = r * groups + i / self.group_size;
                out.push(scales[g] * q as f32 + biases[g]);
            }
        }
        Ok(out)
    }
}

impl AffineWeight<'static> {
    /// Quantizes the row-major `[rows, cols]` matrix `values` as MLX's `mx.quantize` does
    /// on an array of `side_dtype` (F32, F16 or BF16; what scales and biases are stored
    /// as), so a fuse re-quantizes as mlx-lm's does: per group of `group_size` inputs, the
    /// edge of larger magnitude (min or max) is the bias and the scale is chosen so that
    /// zero is exactly representable. As MLX, the values are first rounded to `side_dtype`,
    /// the arithmetic is f32, and the scales and biases are rounded when stored.
    /// [`AffineWeight::dequantize`] gives each value back within about a step.
    pub fn quantize(
        name: &str,
        values: &[f32],
        (rows, cols): (usize, usize),
        (bits, group_size): (u32, usize),
        side_dtype: GgmlType,
    ) -> Result<AffineWeight<'static>> {
        if values.len() != rows * cols {
            return Err(bad(
                name,
                format!("{} values do not fill {rows}×{cols}", values.len()),
            ));
        }
        let fits = [2, 3, 4, 5, 6, 8].contains(&bits)
            && [32, 64, 128].contains(&group_size)
            && cols.is_multiple_of(group_size);
        if !fits {
            return Err(bad(
                name,
                format!("cannot quantize {rows}×{cols} at {bits} bits in groups of {group_size}"),
            ));
        }
        let store: fn(f32) -> f32 = match side_dtype {
            GgmlType::F32 => |x| x,
            GgmlType::F16 => |x| f16::from_f32(x).to_f32(),
            GgmlType::Bf16 => |x| half::bf16::from_f32(x).to_f32(),
            other => return Err(bad(name, format!("scales cannot be stored as {other}"))),
        };
        let groups = cols / group_size;
        let n_bins = ((1u32 << bits) - 1) as f32;
        let mut packed = Vec::with_capacity(rows * cols * bits as usize / 8);
        let (mut scales, mut biases) = (Vec::new(), Vec::new());
        let mut q = vec![0u32; group_size];
        let mut w = vec![0f32; group_size];
        for group in values.chunks_exact(group_size) {
            for (x, &v) in w.iter_mut().zip(group) {
                *x = store(v);
            }
            let lo = w.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let step = ((hi - lo) / n_bins).max(1e-7);
            let (edge, mut scale) = if lo.abs() > hi.abs() {
                (lo, step)
            } else {
                (hi, -step)
            };
            let q0 = (edge / scale).round_ties_even();
            let bias = if q0 == 0.0 {
                0.0
            } else {
                scale = edge / q0;
                edge
            };
            for (slot, &x) in q.iter_mut().zip(&w) {
                *slot = ((x - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u32;
            }
            pack(&q, bits, &mut packed);
            scales.push(store(scale));
            biases.push(store(bias));
        }
        let side = |suffix: &str, v: Vec<f32>| HostWeight {
            name: format!("{name}.{suffix}"),
            dtype: side_dtype,
            shape: vec![rows, groups],
            bytes: Cow::Owned(float_bytes(&v, side_dtype)),
        };
        let w = AffineWeight {
            name: name.to_string(),
            rows,
            cols,
            bits,
            group_size,
            packed: Cow::Owned(packed),
            scales: side("scales", scales),
            biases: side("biases", biases),
        };
        w.validate()?;
        Ok(w)
    }
}

/// Little-endian bytes of `values` as `dtype` (F32, F16 or BF16; round to nearest even).
pub fn float_bytes(values: &[f32], dtype: GgmlType) -> Vec<u8> {
    match dtype {
        GgmlType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::Bf16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|&v| v.to_le_bytes()).collect(),
    }
}

/// Appends the `bits`-wide values to a little-endian bit stream.
fn pack(values: &[u32], bits: u32, out: &mut Vec<u8>) {
    let mut acc: u64 = 0;
    let mut filled = 0u32;
    for &v in values {
        acc |= (v as u64) << filled;
        filled += bits;
        while filled >= 8 {
            out.push(acc as u8);
            acc >>= 8;
            filled -= 8;
        }
    }
    if filled > 0 {
        out.push(acc as u8);
    }
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// `(scale, min)` of sub-block `j` of a K-quant super-block (6-bit packed pairs).
fn k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Groups of 32 quantized values of one GGUF block: `(q, scale, bias)` per group.
type Groups = Vec<([u32; 32], f32, f32)>;

/// Decodes one GGUF block into affine groups of 32; `None` for types that are not
/// exactly affine in groups of 32.
fn block_groups(dtype: GgmlType, b: &[u8]) -> Option<Groups> {
    let mut q = [0u32; 32];
    Some(match dtype {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let d = half_at(b, 0);
            let (bias, qs) = if dtype == GgmlType::Q4_0 {
                (-8.0 * d, &b[2..18])
            } else {
                (half_at(b, 2), &b[4..20])
            };
            for j in 0..16 {
                q[j] = (qs[j] & 0xF) as u32;
                q[j + 16] = (qs[j] >> 4) as u32;
            }
            vec![(q, d, bias)]
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let d = half_at(b, 0);
            let (bias, qh_at) = if dtype == GgmlType::Q5_0 {
                (-16.0 * d, 2)
            } else {
                (half_at(b, 2), 4)
            };
            let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
            let qs = &b[qh_at + 4..qh_at + 20];
            for j in 0..16 {
                q[j] = (qs[j] & 0xF) as u32 | (((qh >> j) & 1) << 4);
                q[j + 16] = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
            }
            vec![(q, d, bias)]
        }
        GgmlType::Q8_0 => {
            let d = half_at(b, 0);
            for (j, v) in q.iter_mut().enumerate() {
                *v = (b[2 + j] as i8 as i32 + 128) as u32;
            }
            vec![(q, d, -128.0 * d)]
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = if dtype == GgmlType::Q5K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            let mut groups = Vec::with_capacity(8);
            for chunk in 0..4 {
                let ql = &qs[chunk * 32..chunk * 32 + 32];
                for half in 0..2 {
                    let (sc, m) = k_scale_min(chunk * 2 + half, scales);
                    for l in 0..32 {
                        let nib = if half == 0 { ql[l] & 0xF } else { ql[l] >> 4 };
                        let high = qh.map_or(0, |h| {
                            let bit = 1u8 << (chunk * 2 + half);
                            if h[l] & bit != 0 {
                                16
                            } else {
                                0
                            }
                        });
                        q[l] = (nib + high) as u32;
                    }
                    groups.push((q, d * sc as f32, -(dmin * m as f32)));
                }
            }
            groups
        }
        _ => return None,
    })
}

/// `(bytes per block, values per block, bits)` of the re-layout-able GGUF types.
fn block_layout(dtype: GgmlType) -> Option<(usize, usize, u32)> {
    Some(match dtype {
        GgmlType::Q4_0 => (18, 32, 4),
        GgmlType::Q4_1 => (20, 32, 4),
        GgmlType::Q5_0 => (22, 32, 5),
        GgmlType::Q5_1 => (24, 32, 5),
        GgmlType::Q8_0 => (34, 32, 8),
        GgmlType::Q4K => (144, 256, 4),
        GgmlType::Q5K => (176, 256, 5),
        _ => return None,
    })
}

/// Whether a GGUF type re-lays out losslessly into the affine layout.
pub fn relayout_exact(dtype: GgmlType) -> bool {
    block_layout(dtype).is_some()
}

/// Re-lays a GGUF-quantized matrix out as affine groups of 32 with f32 scales and biases,
/// value for value (no rounding); `Ok(None)` for types this cannot do exactly.
pub fn from_gguf_blocks(w: &HostWeight<'_>) -> Result<Option<AffineWeight<'static>>> {
    let Some((block_bytes, block_len, bits)) = block_layout(w.dtype) else {
        return Ok(None);
    };
    let [rows, cols] = w.shape[..] else {
        return Err(bad(&w.name, format!("not a matrix: shape {:?}", w.shape)));
    };
    if !cols.is_multiple_of(block_len) || w.bytes.len() != rows * cols / block_len * block_bytes {
        return Err(bad(
            &w.name,
            format!(
                "{} bytes of {} do not hold {rows}×{cols}",
                w.bytes.len(),
                w.dtype
            ),
        ));
    }
    let groups = cols / 32;
    let mut packed = Vec::with_capacity(rows * cols * bits as usize / 8);
    let mut scales = Vec::with_capacity(rows * groups * 4);
    let mut biases = Vec::with_capacity(rows * groups * 4);
    for block in w.bytes.chunks_exact(block_bytes) {
        let Some(gs) = block_groups(w.dtype, block) else {
            return Ok(None);
        };
        for (q, s, b) in gs {
            pack(&q, bits, &mut packed);
            scales.extend_from_slice(&s.to_le_bytes());
            biases.extend_from_slice(&b.to_le_bytes());
        }
    }
    let side = |suffix: &str, bytes: Vec<u8>| HostWeight {
        name: format!("{}.{suffix}", w.name),
        dtype: GgmlType::F32,
        shape: vec![rows, groups],
        bytes: Cow::Owned(bytes),
    };
    Ok(Some(AffineWeight {
        name: w.name.clone(),
        rows,
        cols,
        bits,
        group_size: 32,
        packed: Cow::Owned(packed),
        scales: side("scales", scales),
        biases: side("biases", biases),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(7);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Quantizes random data with candle into `dtype`, re-lays it out, and checks that the
    /// affine values equal candle's dequantization exactly.
    fn roundtrip(dtype: GgmlDType, ours: GgmlType) {
        let (rows, cols) = (4, 512);
        let data = Tensor::from_vec(values(rows * cols, 3), (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&data, dtype).unwrap();
        let reference: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let bytes = q.data().unwrap().to_vec();
        let w = HostWeight {
            name: "w".into(),
            dtype: ours,
            shape: vec![rows, cols],
            bytes: Cow::Owned(bytes),
        };
        let affine = from_gguf_blocks(&w).unwrap().expect("exact re-layout");
        affine.validate().unwrap();
        let got = affine.dequantize().unwrap();
        assert_eq!(got.len(), reference.len());
        for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                "{ours}: value {i}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn gguf_blocks_relayout_losslessly() {
        roundtrip(GgmlDType::Q4_0, GgmlType::Q4_0);
        roundtrip(GgmlDType::Q4_1, GgmlType::Q4_1);
        roundtrip(GgmlDType::Q5_0, GgmlType::Q5_0);
        roundtrip(GgmlDType::Q5_1, GgmlType::Q5_1);
        roundtrip(GgmlDType::Q8_0, GgmlType::Q8_0);
        roundtrip(GgmlDType::Q4K, GgmlType::Q4K);
        roundtrip(GgmlDType::Q5K, GgmlType::Q5K);
    }

    /// `mx.quantize(w, group_size=32, bits=4)` of these values in MLX 0.32, on float32 and
    /// bfloat16 arrays: packed words, scales, biases.
    #[test]
    fn quantize_matches_mlx() {
        let v: Vec<f32> = (0..32)
            .map(|i| ((i * 7) % 32 - 13) as f32 / 10.0)
            .chain((0..32).map(|i| ((i * 5) % 32) as f32 / 40.0 + 0.3))
            .collect();
        let cases = [
            (
                GgmlType::F32,
                [
                    2061588687u32,
                    3206978819,
                    4083863624,
                    917378188,
                    3761605343,
                    2901493403,
                    1757217367,
                    611962387,
                ],
                [-0.199_999_99_f32, -0.051_190_477],
                [1.8_f32, 1.075],
            ),
            (
                GgmlType::Bf16,
                [
                    2078365903, 3206913283, 4083863623, 917378188, 3778382559, 2901558939,
                    1757217623, 611962388,
                ],
                [-0.19921875, -0.051_269_53],
                [1.796875, 1.078125],
            ),
        ];
        for (side, words, scales, biases) in cases {
            let w = AffineWeight::quantize("w", &v, (1, 64), (4, 32), side).unwrap();
            let got: Vec<u32> = w
                .packed
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(got, words, "{side} packed");
            assert_eq!(w.scales.float_values("t").unwrap(), scales, "{side} scales");
            assert_eq!(w.biases.float_values("t").unwrap(), biases, "{side} biases");
        }
    }

    #[test]
    fn quantize_round_trips_within_a_step() {
        let (rows, cols) = (3, 128);
        let v = values(rows * cols, 11);
        for (bits, group, side) in [
            (4, 64, GgmlType::Bf16),
            (8, 32, GgmlType::F16),
            (3, 128, GgmlType::F32),
            (6, 64, GgmlType::F32),
        ] {
            let w = AffineWeight::quantize("w", &v, (rows, cols), (bits, group), side).unwrap();
            assert_eq!(w.scales.dtype, side);
            let back = w.dequantize().unwrap();
            let scales = w.scales.float_values("t").unwrap();
            for (i, (a, b)) in back.iter().zip(&v).enumerate() {
                // Zero is kept exact, which may cost the far edge up to a step.
                let step = scales[i / group].abs();
                assert!(
                    (a - b).abs() <= 1.05 * step + 1e-6,
                    "{bits}-bit/{group}: value {i}: {a} vs {b} (step {step})"
                );
            }
        }
    }

    #[test]
    fn other_types_are_not_claimed() {
        let w = HostWeight {
            name: "w".into(),
            dtype: GgmlType::Q6K,
            shape: vec![1, 256],
            bytes: Cow::Owned(vec![0; 210]),
        };
        assert!(from_gguf_blocks(&w).unwrap().is_none());
        assert!(!relayout_exact(GgmlType::Q6K));
    }

    #[test]
    fn packing_is_a_little_endian_bit_stream() {
        let mut out = Vec::new();
        pack(&[1, 2, 3, 4, 5, 6, 7, 0], 3, &mut out);
        // 1 | 2<<3 | 3<<6 | 4<<9 | 5<<12 | 6<<15 | 7<<18 = 0x1f58d1
        assert_eq!(out, vec![0xd1, 0x58, 0x1f]);
        let w = AffineWeight {
            name: "w".into(),
            rows: 1,
            cols: 32,
            bits: 3,
            group_size: 32,
            packed: Cow::Owned({
                let mut p = Vec::new();
                pack(&(0..32).map(|i| i % 8).collect::<Vec<_>>(), 3, &mut p);
                p
            }),
            scales: HostWeight {
                name: "s".into(),
                dtype: GgmlType::F32,
                shape: vec![1, 1],
                bytes: Cow::Owned(0.5f32.to_le_bytes().to_vec()),
            },
            biases: HostWeight {
                name: "b".into(),
                dtype: GgmlType::F32,
                shape: vec![1, 1],
                bytes: Cow::Owned((-1.0f32).to_le_bytes().to_vec()),
            },
        };
        let v = w.dequantize().unwrap();
        assert_eq!(v[..4], [-1.0, -0.5, 0.0, 0.5]);
        assert_eq!(v[15], 7.0 * 0.5 - 1.0);
    }

    #[test]
    fn validation_names_the_problem() {
        let mut w = from_gguf_blocks(&HostWeight {
            name: "blk.0.attn_q.weight".into(),
            dtype: GgmlType::Q8_0,
            shape: vec![1, 32],
            bytes: Cow::Owned(vec![0; 34]),
        })
        .unwrap()
        .unwrap();
        w.bits = 7;
        let e = w.validate().unwrap_err().to_string();
        assert!(e.contains("7-bit") && e.contains("attn_q"), "{e}");
    }
}
