//! The 32-element "legacy" blocks: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.
//!
//! Nibbles: byte `j` of `qs` holds element `j` (low nibble) and element `j + 16` (high
//! nibble). Q5 blocks add a 32-bit word `qh` whose bit `i` is bit 4 of element `i`.
use super::{f16_at, Codes};

fn nibbles(c: &mut Codes, qs: &[u8]) {
    for j in 0..16 {
        c.q[j] = qs[j] & 0x0F;
        c.q[j + 16] = qs[j] >> 4;
    }
}

fn high_bits(c: &mut Codes, qh: u32) {
    for (i, v) in c.q[..32].iter_mut().enumerate() {
        *v |= (((qh >> i) & 1) as u8) << 4;
    }
}

fn block(d: f32, m: f32, zero: i32) -> Codes {
    let mut c = Codes::new(32, 32, zero);
    c.scales[0] = d;
    c.mins[0] = m;
    c
}

fn qh_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// `d: f16, qs: [u8; 16]`, value `d · (q − 8)`.
pub(super) fn q4_0(b: &[u8]) -> Codes {
    let mut c = block(f16_at(b, 0), 0.0, 8);
    nibbles(&mut c, &b[2..18]);
    c
}

/// `d: f16, m: f16, qs: [u8; 16]`, value `d · q + m`.
pub(super) fn q4_1(b: &[u8]) -> Codes {
    let mut c = block(f16_at(b, 0), f16_at(b, 2), 0);
    nibbles(&mut c, &b[4..20]);
    c
}

/// `d: f16, qh: u32, qs: [u8; 16]`, value `d · (q − 16)`.
pub(super) fn q5_0(b: &[u8]) -> Codes {
    let mut c = block(f16_at(b, 0), 0.0, 16);
    nibbles(&mut c, &b[6..22]);
    high_bits(&mut c, qh_at(b, 2));
    c
}

/// `d: f16, m: f16, qh: u32, qs: [u8; 16]`, value `d · q + m`.
pub(super) fn q5_1(b: &[u8]) -> Codes {
    let mut c = block(f16_at(b, 0), f16_at(b, 2), 0);
    nibbles(&mut c, &b[8..24]);
    high_bits(&mut c, qh_at(b, 4));
    c
}

/// `d: f16, qs: [i8; 32]`, value `d · qs`; codes are `qs + 128`.
pub(super) fn q8_0(b: &[u8]) -> Codes {
    let mut c = block(f16_at(b, 0), 0.0, 128);
    for (o, &v) in c.q.iter_mut().zip(&b[2..34]) {
        *o = v ^ 0x80;
    }
    c
}
