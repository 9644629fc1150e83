//! Portable kernels over the strip layout: the fallback on any CPU, and the statement of
//! the exact arithmetic the SIMD families reproduce.
use std::ops::Range;

use super::Output;
use crate::ggml::{bf16_bits_to_f32, f16_bits_to_f32};
use crate::packed::{lane_codes, lane_scales, ScaleKind, STRIP};
use crate::{PackedMatrix, QuantizedActivations, WeightFormat};

pub(super) unsafe fn quantized(
    w: &PackedMatrix,
    strips: Range<usize>,
    act: &QuantizedActivations,
    tokens: Range<usize>,
    out: Output,
) {
    let Some(scheme) = w.scheme() else { return };
    let l = w.layout();
    let (cols, nb) = (w.cols(), l.nb);
    let mut q = [0u8; 32];
    for s in strips {
        let strip = w.strip(s);
        for lane in 0..STRIP {
            let row = s * STRIP + lane;
            if row >= out.rows {
                break;
            }
            for t in tokens.clone() {
                let xq = &act.qs[t * cols..(t + 1) * cols];
                let mut acc = 0f32;
                for b in 0..nb {
                    lane_codes(strip, l, scheme.bits, lane, b, &mut q);
                    let sc = lane_scales(strip, l, scheme.scales, lane, b);
                    let x = &xq[32 * b..32 * b + 32];
                    let at = t * nb + b;
                    let dx = act.d[at];
                    let dot =
                        |r: Range<usize>| -> i32 { r.map(|c| q[c] as i32 * x[c] as i32).sum() };
                    if scheme.scales == ScaleKind::K16 {
                        let mut blk = 0i32;
                        for half in 0..2 {
                            let sum = act.sum16[2 * at + half];
                            let part = dot(16 * half..16 * half + 16) - scheme.zero * sum;
                            blk += part * sc.sub[half];
                        }
                        acc = (blk as f32).mul_add(sc.d * dx, acc);
                    } else {
                        let int = dot(0..32) - scheme.zero * act.sum32[at];
                        acc = (int as f32).mul_add(sc.scale[0] * dx, acc);
                        if matches!(
                            scheme.scales,
                            ScaleKind::Block { min: true } | ScaleKind::KMin
                        ) {
                            acc = sc.min.mul_add(act.dsum[at], acc);
                        }
                    }
                }
                if !out.bias.is_null() {
                    acc += *out.bias.add(row);
                }
                *out.ptr.add(t * out.ld + row) = acc;
            }
        }
    }
}

pub(super) unsafe fn float(
    w: &PackedMatrix,
    strips: Range<usize>,
    x: &[f32],
    tokens: Range<usize>,
    out: Output,
) {
    let cols = w.cols();
    let size = w.format().block_bytes();
    for s in strips {
        let strip = w.strip(s);
        for lane in 0..STRIP {
            let row = s * STRIP + lane;
            if row >= out.rows {
                break;
            }
            for t in tokens.clone() {
                let xr = &x[t * cols..(t + 1) * cols];
                let mut acc = 0f32;
                for (k, &xv) in xr.iter().enumerate() {
                    let at = (k * STRIP + lane) * size;
                    let b = &strip[at..at + size];
                    let wv = match w.format() {
                        WeightFormat::F16 => f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])),
                        WeightFormat::Bf16 => bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])),
                        _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                    };
                    acc = wv.mul_add(xv, acc);
                }
                if !out.bias.is_null() {
                    acc += *out.bias.add(row);
                }
                *out.ptr.add(t * out.ld + row) = acc;
            }
        }
    }
}
