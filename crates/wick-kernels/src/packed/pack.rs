//! From ggml's row-major blocks to the strip layout, strips packed in parallel.
use super::layout::{Bits, ScaleKind, Scheme, StripLayout, STRIP};
use crate::ggml::{block_codes, q6k_scales, raw_scale_mins, super_scales_bits};
use crate::WeightFormat;

/// Fills `dst` (zeroed, `strips × layout.stride` bytes) from the file bytes `src`.
pub(super) fn pack(
    format: WeightFormat,
    scheme: Option<Scheme>,
    layout: StripLayout,
    rows: usize,
    cols: usize,
    src: &[u8],
    dst: &mut [u8],
) {
    let row_bytes = src.len() / rows.max(1);
    let pack_strip = |s: usize, strip: &mut [u8]| {
        for lane in 0..STRIP {
            let row = s * STRIP + lane;
            if row >= rows {
                break;
            }
            let src = &src[row * row_bytes..(row + 1) * row_bytes];
            match scheme {
                Some(scheme) => quantized_row(format, scheme, layout, src, strip, lane),
                None => float_row(format, cols, src, strip, lane),
            }
        }
    };
    match (scheme, format) {
        (None, WeightFormat::F32) => return pack_float::<4>(rows, cols, src, dst, layout.stride),
        (None, WeightFormat::F16 | WeightFormat::Bf16) => {
            return pack_float::<2>(rows, cols, src, dst, layout.stride)
        }
        _ => {}
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let total = dst.len();
    let strips: Vec<(usize, &mut [u8])> = dst.chunks_exact_mut(layout.stride).enumerate().collect();
    // Threads pay off on large matrices only (a LoRA factor packs faster than a spawn).
    if threads == 1 || strips.len() < 64 || total < PARALLEL_BYTES {
        for (s, strip) in strips {
            pack_strip(s, strip);
        }
        return;
    }
    let per = strips.len().div_ceil(threads);
    let mut strips = strips;
    std::thread::scope(|scope| {
        while !strips.is_empty() {
            let rest = strips.split_off(per.min(strips.len()));
            let chunk = std::mem::replace(&mut strips, rest);
            let pack_strip = &pack_strip;
            scope.spawn(move || {
                for (s, strip) in chunk {
                    pack_strip(s, strip);
                }
            });
        }
    });
}

/// Bytes of a packed matrix under which it is packed on the calling thread.
const PARALLEL_BYTES: usize = 1 << 22;

/// [`pack`] of a float matrix of `SIZE`-byte values (f32, f16, bf16): each strip is
/// `[cols][16]` values, written in order.
fn pack_float<const SIZE: usize>(
    rows: usize,
    cols: usize,
    src: &[u8],
    dst: &mut [u8],
    stride: usize,
) {
    for (s, strip) in dst.chunks_exact_mut(stride).enumerate() {
        let lanes = rows.saturating_sub(s * STRIP).min(STRIP);
        let src_rows: Vec<&[u8]> = (0..lanes)
            .map(|l| &src[(s * STRIP + l) * cols * SIZE..(s * STRIP + l + 1) * cols * SIZE])
            .collect();
        for (k, group) in strip.chunks_exact_mut(STRIP * SIZE).take(cols).enumerate() {
            for (lane, row) in src_rows.iter().enumerate() {
                group[lane * SIZE..(lane + 1) * SIZE]
                    .copy_from_slice(&row[k * SIZE..(k + 1) * SIZE]);
            }
        }
    }
}

fn float_row(format: WeightFormat, cols: usize, src: &[u8], strip: &mut [u8], lane: usize) {
    let size = format.block_bytes();
    for k in 0..cols {
        let at = (k * STRIP + lane) * size;
        strip[at..at + size].copy_from_slice(&src[k * size..(k + 1) * size]);
    }
}

fn quantized_row(
    format: WeightFormat,
    scheme: Scheme,
    l: StripLayout,
    src: &[u8],
    strip: &mut [u8],
    lane: usize,
) {
    let per_block = format.block_elems() / 32;
    for (fb, bytes) in src.chunks_exact(format.block_bytes()).enumerate() {
        if !legacy_codes_into(format, strip, l, lane, fb, bytes) {
            // Blocks come from our own chunking of a length-checked row, so decoding
            // cannot fail; a zero block is the harmless answer if it ever did.
            let Ok(codes) = block_codes(format, bytes) else {
                continue;
            };
            for sub in 0..per_block {
                let b = fb * per_block + sub;
                let q = &codes.q[32 * sub..32 * sub + 32];
                codes_into(strip, l, scheme.bits, lane, b, q);
            }
        }
        match scheme.scales {
            ScaleKind::Block { min } => {
                let at = l.block_scales + if min { 64 } else { 32 } * fb + 2 * lane;
                strip[at..at + 2].copy_from_slice(&bytes[0..2]);
                if min {
                    strip[at + 32..at + 34].copy_from_slice(&bytes[2..4]);
                }
            }
            ScaleKind::KMin => {
                let (d, dmin) = super_scales_bits(bytes);
                let sup = l.super_scales + 64 * fb + 2 * lane;
                strip[sup..sup + 2].copy_from_slice(&d.to_le_bytes());
                strip[sup + 32..sup + 34].copy_from_slice(&dmin.to_le_bytes());
                for (j, (sc, mn)) in raw_scale_mins(bytes).into_iter().enumerate() {
                    let at = l.block_scales + 32 * (fb * 8 + j) + lane;
                    strip[at] = sc;
                    strip[at + 16] = mn;
                }
            }
            ScaleKind::K16 => {
                let (d, sc) = q6k_scales(bytes);
                let sup = l.super_scales + 64 * fb + 2 * lane;
                strip[sup..sup + 2].copy_from_slice(&d.to_le_bytes());
                for j in 0..8 {
                    let at = l.block_scales + 32 * (fb * 8 + j) + lane;
                    strip[at] = sc[2 * j] as u8;
                    strip[at + 16] = sc[2 * j + 1] as u8;
                }
            }
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The fast path for the 32-element formats (most bytes of most files): nibbles and
/// high bits go straight from the file block to the planes, four codes per word.
/// Returns false for formats it does not handle.
fn legacy_codes_into(
    format: WeightFormat,
    strip: &mut [u8],
    l: StripLayout,
    lane: usize,
    b: usize,
    bytes: &[u8],
) -> bool {
    let (qs_at, qh_at) = match format {
        WeightFormat::Q4_0 => (2, None),
        WeightFormat::Q4_1 => (4, None),
        WeightFormat::Q5_0 => (6, Some(2)),
        WeightFormat::Q5_1 => (8, Some(4)),
        WeightFormat::Q8_0 => {
            for i in 0..8 {
                let word = u32_at(bytes, 2 + 4 * i) ^ 0x8080_8080;
                let at = 512 * b + 64 * i + 4 * lane;
                strip[at..at + 4].copy_from_slice(&word.to_le_bytes());
            }
            return true;
        }
        _ => return false,
    };
    // Group g holds columns 8g..8g+4 (low nibbles) and 8g+4..8g+8 (high nibbles); in the
    // file, column i < 16 is the low nibble of qs[i], column i ≥ 16 the high nibble of
    // qs[i − 16].
    for g in 0..4 {
        let shift = 4 * (g / 2);
        let lo = (u32_at(bytes, qs_at + 8 * (g % 2)) >> shift) & 0x0F0F_0F0F;
        let hi = (u32_at(bytes, qs_at + 8 * (g % 2) + 4) >> shift) & 0x0F0F_0F0F;
        let at = 256 * b + 64 * g + 4 * lane;
        strip[at..at + 4].copy_from_slice(&(lo | (hi << 4)).to_le_bytes());
    }
    if let Some(qh_at) = qh_at {
        let qh = u32_at(bytes, qh_at);
        for word in 0..8 {
            let nibble = ((qh >> (4 * word)) & 0x0F) as u8;
            strip[l.masks + 64 * b + 8 * word + lane / 2] |= nibble << (4 * (lane % 2));
        }
    }
    true
}

/// Writes the 32 codes of row `lane`, block `b`, into the data and mask planes.
fn codes_into(strip: &mut [u8], l: StripLayout, bits: Bits, lane: usize, b: usize, q: &[u8]) {
    let Ok(q) = <&[u8; 32]>::try_from(q) else {
        return;
    };
    if bits == Bits::Eight {
        for i in 0..8 {
            let at = 512 * b + 64 * i + 4 * lane;
            strip[at..at + 4].copy_from_slice(&q[4 * i..4 * i + 4]);
        }
        return;
    }
    for g in 0..4 {
        let mut word = [0u8; 4];
        for (j, w) in word.iter_mut().enumerate() {
            *w = (q[8 * g + j] & 0x0F) | ((q[8 * g + 4 + j] & 0x0F) << 4);
        }
        let at = 256 * b + 64 * g + 4 * lane;
        strip[at..at + 4].copy_from_slice(&word);
    }
    // Bit `bit` of the high code bits as one nibble per (group, half): bit j ↔ column j.
    let nibble = |g: usize, h: usize, bit: u32| -> u8 {
        (0..4).fold(0u8, |n, j| n | (((q[8 * g + 4 * h + j] >> bit) & 1) << j))
    };
    let mut plane = |base: usize, bit: u32| {
        for g in 0..4 {
            for h in 0..2 {
                let at = base + 8 * (2 * g + h) + lane / 2;
                strip[at] |= nibble(g, h, bit) << (4 * (lane % 2));
            }
        }
    };
    match bits {
        Bits::Five => plane(l.masks + 64 * b, 4),
        Bits::Six => {
            plane(l.masks + 128 * b, 4);
            plane(l.masks + 128 * b + 64, 5);
        }
        _ => {}
    }
}
