//! [`PackedMatrix`]: a weight matrix repacked once, at load, into the strip layout the
//! kernels stream (see [`layout`] for the bytes).
mod aligned;
pub(crate) mod layout;
mod pack;

use aligned::AlignedBytes;
pub(crate) use layout::{Bits, ScaleKind, Scheme, StripLayout, STRIP};

use crate::ggml::{bf16_bits_to_f32, f16_bits_to_f32};
use crate::{KernelError, Result, WeightFormat};

/// A `[rows, cols]` weight matrix in wick's strip layout, ready for
/// [`crate::matmul`]. Quantized formats keep their codes and scales (same size as the
/// file); nothing is dequantized.
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    layout: StripLayout,
    scheme: Option<Scheme>,
    bytes: AlignedBytes,
}

impl PackedMatrix {
    /// Repacks a row-major matrix as a GGUF or safetensors file stores it (`rows` rows of
    /// `format.row_bytes(cols)` bytes).
    pub fn from_ggml(format: WeightFormat, rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        let row_bytes = format.row_bytes(cols)?;
        if bytes.len() != rows * row_bytes {
            return Err(KernelError::ByteLength {
                what: "weight matrix",
                expected: rows * row_bytes,
                found: bytes.len(),
            });
        }
        let scheme = Scheme::of(format);
        let layout = match scheme {
            Some(s) => StripLayout::quantized(s, cols),
            None => StripLayout::float(format, cols),
        };
        let strips = rows.div_ceil(STRIP);
        let mut packed = AlignedBytes::zeroed(strips * layout.stride);
        pack::pack(
            format,
            scheme,
            layout,
            rows,
            cols,
            bytes,
            packed.as_mut_slice(),
        );
        Ok(PackedMatrix {
            format,
            rows,
            cols,
            layout,
            scheme,
            bytes: packed,
        })
    }

    /// The element format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn byte_size(&self) -> usize {
        self.bytes.len()
    }

    /// Strips of 16 rows (the last one zero-padded).
    pub(crate) fn strips(&self) -> usize {
        self.rows.div_ceil(STRIP)
    }

    pub(crate) fn layout(&self) -> StripLayout {
        self.layout
    }

    pub(crate) fn scheme(&self) -> Option<Scheme> {
        self.scheme
    }

    /// Bytes of strip `s`.
    pub(crate) fn strip(&self, s: usize) -> &[u8] {
        let st = self.layout.stride;
        &self.bytes.as_slice()[s * st..(s + 1) * st]
    }

    /// Row `row` as f32 (for embedding lookups), bit-identical to ggml's dequantization.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<()> {
        if row >= self.rows {
            return Err(KernelError::RowOutOfRange {
                row,
                rows: self.rows,
            });
        }
        if out.len() != self.cols {
            return Err(KernelError::Shape {
                op: "dequantize_row",
                what: "output",
                expected: self.cols,
                found: out.len(),
            });
        }
        let strip = self.strip(row / STRIP);
        let lane = row % STRIP;
        let Some(scheme) = self.scheme else {
            let size = self.format.block_bytes();
            for (k, o) in out.iter_mut().enumerate() {
                let at = (k * STRIP + lane) * size;
                let b = &strip[at..at + size];
                *o = match self.format {
                    WeightFormat::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                    WeightFormat::F16 => f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])),
                    _ => bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])),
                };
            }
            return Ok(());
        };
        let mut q = [0u8; 32];
        for (b, o) in out.chunks_exact_mut(32).enumerate() {
            lane_codes(strip, self.layout, scheme.bits, lane, b, &mut q);
            let s = lane_scales(strip, self.layout, scheme.scales, lane, b);
            for (c, (o, &q)) in o.iter_mut().zip(&q).enumerate() {
                let half = c / 16;
                *o = s.scale[half] * (q as i32 - scheme.zero) as f32 + s.min;
            }
        }
        Ok(())
    }
}

/// The scales of one row's block as f32: `scale[0]` for columns 0..16, `scale[1]` for
/// 16..32 (equal unless Q6_K), and the min.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneScales {
    pub(crate) scale: [f32; 2],
    pub(crate) min: f32,
    /// Q6_K only: the integer sub-block scales and the f32 super-block `d`.
    pub(crate) sub: [i32; 2],
    pub(crate) d: f32,
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Scales of row `lane` in block `b` of a strip.
pub(crate) fn lane_scales(
    strip: &[u8],
    l: StripLayout,
    kind: ScaleKind,
    lane: usize,
    b: usize,
) -> LaneScales {
    match kind {
        ScaleKind::Block { min } => {
            let at = l.block_scales + if min { 64 } else { 32 } * b + 2 * lane;
            let d = f16_at(strip, at);
            LaneScales {
                scale: [d, d],
                min: if min { f16_at(strip, at + 32) } else { 0.0 },
                sub: [1, 1],
                d,
            }
        }
        ScaleKind::KMin => {
            let sup = l.super_scales + 64 * (b / 8) + 2 * lane;
            let (d, dmin) = (f16_at(strip, sup), f16_at(strip, sup + 32));
            let at = l.block_scales + 32 * b + lane;
            let (sc, mn) = (strip[at], strip[at + 16]);
            let s = d * sc as f32;
            LaneScales {
                scale: [s, s],
                min: -(dmin * mn as f32),
                sub: [sc as i32, sc as i32],
                d,
            }
        }
        ScaleKind::K16 => {
            let d = f16_at(strip, l.super_scales + 64 * (b / 8) + 2 * lane);
            let at = l.block_scales + 32 * b + lane;
            let (s0, s1) = (strip[at] as i8, strip[at + 16] as i8);
            LaneScales {
                scale: [d * s0 as f32, d * s1 as f32],
                min: 0.0,
                sub: [s0 as i32, s1 as i32],
                d,
            }
        }
    }
}

/// The 32 codes of row `lane` in block `b` of a strip.
pub(crate) fn lane_codes(
    strip: &[u8],
    l: StripLayout,
    bits: Bits,
    lane: usize,
    b: usize,
    q: &mut [u8; 32],
) {
    if bits == Bits::Eight {
        for (c, q) in q.iter_mut().enumerate() {
            *q = strip[512 * b + 64 * (c / 4) + 4 * lane + c % 4];
        }
        return;
    }
    for (c, q) in q.iter_mut().enumerate() {
        let (g, j, h) = (c / 8, c % 4, (c % 8) / 4);
        let byte = strip[256 * b + 64 * g + 4 * lane + j];
        let mut v = if h == 0 { byte & 0x0F } else { byte >> 4 };
        let word = 2 * g + h;
        let bit = 4 * lane + j;
        let mask_bit = |at: usize| {
            let w = u64::from_le_bytes(strip[at..at + 8].try_into().unwrap_or([0; 8]));
            ((w >> bit) & 1) as u8
        };
        match bits {
            Bits::Five => v |= mask_bit(l.masks + 64 * b + 8 * word) << 4,
            Bits::Six => {
                v |= mask_bit(l.masks + 128 * b + 8 * word) << 4;
                v |= mask_bit(l.masks + 128 * b + 64 + 8 * word) << 5;
            }
            _ => {}
        }
        *q = v;
    }
}
