//! The 256-element k-quant super-blocks: Q4_K, Q5_K and Q6_K.
//!
//! Q4_K/Q5_K: `d: f16, dmin: f16, scales: [u8; 12]` (eight 6-bit scales and eight 6-bit
//! mins), then for Q5_K `qh: [u8; 32]`, then `qs: [u8; 128]`. Each 64-element chunk `c`
//! reads 32 bytes of `qs`: low nibbles are sub-block `2c`, high nibbles sub-block `2c + 1`;
//! Q5_K's fifth bit of element `l` of those sub-blocks is bit `2c` (resp. `2c + 1`) of
//! `qh[l]`.
//!
//! Q6_K: `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`, sixteen 16-element
//! sub-blocks, value `d · sc · (q − 32)`.
use super::{f16_at, Codes};

/// Scale and min of sub-block `j` from the packed 12-byte table.
fn scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// A Q4_K/Q5_K block's codes container with sub-block scales `d · sc` and mins
/// `−(dmin · mn)` filled in.
fn with_scales_mins(b: &[u8]) -> Codes {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let mut c = Codes::new(256, 32, 0);
    for j in 0..8 {
        let (sc, mn) = scale_min(j, &b[4..16]);
        c.scales[j] = d * sc as f32;
        c.mins[j] = -(dmin * mn as f32);
    }
    c
}

/// The raw 6-bit scale and min of every sub-block (for the packer, which keeps them
/// as integers).
pub(crate) fn raw_scale_mins(b: &[u8]) -> [(u8, u8); 8] {
    let mut out = [(0, 0); 8];
    for (j, o) in out.iter_mut().enumerate() {
        *o = scale_min(j, &b[4..16]);
    }
    out
}

fn nibble_chunks(c: &mut Codes, qs: &[u8]) {
    for k in 0..4 {
        for l in 0..32 {
            c.q[64 * k + l] = qs[32 * k + l] & 0x0F;
            c.q[64 * k + 32 + l] = qs[32 * k + l] >> 4;
        }
    }
}

pub(super) fn q4k(b: &[u8]) -> Codes {
    let mut c = with_scales_mins(b);
    nibble_chunks(&mut c, &b[16..144]);
    c
}

pub(super) fn q5k(b: &[u8]) -> Codes {
    let mut c = with_scales_mins(b);
    nibble_chunks(&mut c, &b[48..176]);
    let qh = &b[16..48];
    for k in 0..4 {
        for l in 0..32 {
            c.q[64 * k + l] |= ((qh[l] >> (2 * k)) & 1) << 4;
            c.q[64 * k + 32 + l] |= ((qh[l] >> (2 * k + 1)) & 1) << 4;
        }
    }
    c
}

pub(super) fn q6k(b: &[u8]) -> Codes {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    let mut c = Codes::new(256, 16, 32);
    for half in 0..2 {
        let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
        let q = &mut c.q[128 * half..];
        for l in 0..32 {
            q[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            q[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    for (o, &s) in c.scales.iter_mut().zip(sc) {
        *o = d * (s as i8) as f32;
    }
    c
}

/// Super-block scale (f16 bits) and the sixteen signed sub-block scales of a Q6_K block.
pub(crate) fn q6k_scales(b: &[u8]) -> (u16, [i8; 16]) {
    let mut sc = [0i8; 16];
    for (o, &s) in sc.iter_mut().zip(&b[192..208]) {
        *o = s as i8;
    }
    (u16::from_le_bytes([b[208], b[209]]), sc)
}

/// Super-block scale and min of a Q4_K/Q5_K block (f16 bits).
pub(crate) fn super_scales_bits(b: &[u8]) -> (u16, u16) {
    (
        u16::from_le_bytes([b[0], b[1]]),
        u16::from_le_bytes([b[2], b[3]]),
    )
}
