//! Vectorized `exp` for the attention softmax, bit-identical to glibc's `expf`.
//!
//! The softmax exponentiates every score once (`exp(s − max)`, so the inputs lie in
//! `[−∞, 0]`), and a scalar libm call per score is a large share of batched decode
//! attention. [`exp_in_place`] does the same work 16 (AVX-512F) or 8 (AVX2+FMA) lanes at a
//! time while returning exactly the bits `f32::exp` returns on x86-64 glibc: it reproduces
//! glibc's `expf` algorithm (glibc ≥ 2.28, the optimized-routines design) step for step as the
//! FMA build `__expf_fma` executes it — the argument is scaled by `32/ln 2` in double precision
//! and rounded to an integer `k` with the `0x1.8p52` shift trick, `2^(k/32)` comes from a
//! 32-entry table plus an exponent add, a cubic polynomial corrects for the remainder, and the
//! double result is rounded once to `f32`. Which products are fused into FMAs was read off the
//! disassembly of `__expf_fma` and is confirmed by the exhaustive tests below, which compare
//! every `f32` in `[−104, 0]` bit for bit with `f32::exp`. Models re-quantize activations
//! between layers and amplify last-bit differences, so nothing looser would do.
//!
//! glibc's own special cases are reproduced too: `−∞` and arguments below `log 2^−150` give
//! `0`, arguments in `[log 2^−150, log 2^−149)` give the smallest subnormal. Lanes outside the
//! reproduced range (NaN, `x > log 2^128`) are handed to the scalar `f32::exp`; they never occur
//! in a softmax. On a vector-capable x86-64 host whose libm differs from glibc the vector
//! results are still deterministic (they are this module's exp, not the platform's); on other
//! targets, or x86-64 CPUs without AVX2+FMA, every element goes through the scalar `f32::exp`.

/// `32 / ln 2`, the scale that turns `x` into units of `ln 2 / 32`.
const INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652b_82fe);
/// `0x1.8p52`: adding it rounds a double of magnitude below `2^51` to an integer, which then
/// sits in the low mantissa bits (two's complement).
const SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000);
/// Cubic coefficient of `2^(r/32)` on `|r| ≤ 1/2`.
const C0: f64 = f64::from_bits(0x3ebc_6af8_4b91_2394);
/// Quadratic coefficient of `2^(r/32)`.
const C1: f64 = f64::from_bits(0x3f2e_bfce_50fa_c4f3);
/// Linear coefficient of `2^(r/32)`.
const C2: f64 = f64::from_bits(0x3f96_2e42_ff0c_52d6);

/// `bits(2^(i/32)) − (i << 47)`: adding `k << 47` to entry `k mod 32` yields `bits(2^(k/32))`,
/// the table's own index contribution to the exponent field taken out in advance.
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];

/// `log 2^128` rounded down: above it glibc overflows (handled by the scalar fallback).
const OVERFLOW_BOUND: f32 = f32::from_bits(0x42b1_7217);
/// `log 2^−150`: below it (and at `−∞`) the result is `0`.
const UNDERFLOW_BOUND: f32 = f32::from_bits(0xc2cf_f1b4);
/// `log 2^−149`: from [`UNDERFLOW_BOUND`] up to here glibc returns the smallest subnormal.
const MAY_UNDERFLOW_BOUND: f32 = f32::from_bits(0xc2ce_8ecf);
/// glibc's result between the two underflow bounds (`0x1.4p−75f²`, rounded): `2^−149`.
const SMALLEST_SUBNORMAL: f32 = f32::from_bits(1);

/// Replaces each `x` in `xs` with `exp(x)`, bit-identical to `x.exp()` on x86-64 glibc.
///
/// Uses AVX-512F or AVX2+FMA when the CPU has them (checked at run time, so a generic build
/// is safe) and the scalar `f32::exp` otherwise; a slice of any length is accepted.
pub(crate) fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            unsafe { x86::exp_avx512(xs) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            unsafe { x86::exp_avx2(xs) };
            return;
        }
    }
    for x in xs {
        *x = x.exp();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX-512F and AVX2+FMA bodies of [`super::exp_in_place`].
    use std::arch::x86_64::*;

    use super::{
        C0, C1, C2, INV_LN2_N, MAY_UNDERFLOW_BOUND, OVERFLOW_BOUND, SHIFT, SMALLEST_SUBNORMAL,
        TABLE, UNDERFLOW_BOUND,
    };

    /// Lanes per AVX-512 step.
    const W512: usize = 16;
    /// Lanes per AVX2 step.
    const W256: usize = 8;

    /// The algorithm's core on eight doubles (widened `f32`s), rounded back to eight `f32`s.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn core512(xd: __m512d, table: &[__m512d; 4]) -> __m256 {
        let inv = _mm512_set1_pd(INV_LN2_N);
        let shift = _mm512_set1_pd(SHIFT);
        // kd + SHIFT = fma(InvLn2N, xd, SHIFT); its bits hold k in the low mantissa.
        let kd_shifted = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(kd_shifted);
        let kd = _mm512_sub_pd(kd_shifted, shift);
        // r = InvLn2N·xd − kd, fused (the product is never rounded on its own).
        let r = _mm512_fmsub_pd(inv, xd, kd);
        // TABLE[k mod 32]: bits 0–3 pick within a 16-entry half, bit 4 picks the half.
        let low = _mm512_permutex2var_pd(table[0], ki, table[1]);
        let high = _mm512_permutex2var_pd(table[2], ki, table[3]);
        let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let entry = _mm512_castpd_si512(_mm512_mask_blend_pd(upper, low, high));
        let s = _mm512_castsi512_pd(_mm512_add_epi64(entry, _mm512_slli_epi64::<47>(ki)));
        let z = _mm512_fmadd_pd(_mm512_set1_pd(C0), r, _mm512_set1_pd(C1));
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(_mm512_set1_pd(C2), r, _mm512_set1_pd(1.0));
        let y = _mm512_fmadd_pd(z, r2, y);
        _mm512_cvtpd_ps(_mm512_mul_pd(y, s))
    }

    /// exp of sixteen `f32`s with glibc's special cases; returns the lanes (bit mask) that need
    /// the scalar fallback (NaN or above [`OVERFLOW_BOUND`]).
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn exp16(x: __m512, table: &[__m512d; 4]) -> (__m512, __mmask16) {
        let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
        let hi_half = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x));
        let hi = _mm512_cvtps_pd(_mm256_castpd_ps(hi_half));
        let lo = core512(lo, table);
        let hi = core512(hi, table);
        let both = _mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
            _mm256_castps_pd(hi),
        );
        let y = _mm512_castpd_ps(both);
        let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(MAY_UNDERFLOW_BOUND));
        let y = _mm512_mask_blend_ps(tiny, y, _mm512_set1_ps(SMALLEST_SUBNORMAL));
        let zero = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(UNDERFLOW_BOUND));
        let y = _mm512_mask_blend_ps(zero, y, _mm512_setzero_ps());
        let slow = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(x, _mm512_set1_ps(OVERFLOW_BOUND));
        (y, slow)
    }

    /// [`super::exp_in_place`] with AVX-512F, sixteen lanes a step, the tail masked.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_avx512(xs: &mut [f32]) {
        let t = TABLE.as_ptr() as *const f64;
        let table = [
            _mm512_loadu_pd(t),
            _mm512_loadu_pd(t.add(8)),
            _mm512_loadu_pd(t.add(16)),
            _mm512_loadu_pd(t.add(24)),
        ];
        for chunk in xs.chunks_mut(W512) {
            let n = chunk.len();
            let live: __mmask16 = if n == W512 { !0 } else { (1u16 << n) - 1 };
            let p = chunk.as_mut_ptr();
            // SAFETY (of the masked load and store): lanes at or past `n` are masked off, so
            // only the chunk's own `n` elements are read and written.
            let x = _mm512_maskz_loadu_ps(live, p);
            let (y, slow) = exp16(x, &table);
            _mm512_mask_storeu_ps(p, live, y);
            let slow = slow & live;
            if slow != 0 {
                let mut original = [0f32; W512];
                _mm512_storeu_ps(original.as_mut_ptr(), x);
                for (i, (out, x)) in chunk.iter_mut().zip(original).enumerate() {
                    if slow & (1 << i) != 0 {
                        *out = x.exp();
                    }
                }
            }
        }
    }

    /// The algorithm's core on four doubles, rounded back to four `f32`s (AVX2+FMA twin of
    /// [`core512`]).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn core256(xd: __m256d) -> __m128 {
        let inv = _mm256_set1_pd(INV_LN2_N);
        let shift = _mm256_set1_pd(SHIFT);
        let kd_shifted = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(kd_shifted);
        let kd = _mm256_sub_pd(kd_shifted, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let index = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY (of the gather): every index is masked to 0..32, inside TABLE.
        let entry = _mm256_i64gather_epi64::<8>(TABLE.as_ptr() as *const i64, index);
        let s = _mm256_castsi256_pd(_mm256_add_epi64(entry, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(_mm256_set1_pd(C0), r, _mm256_set1_pd(C1));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(_mm256_set1_pd(C2), r, _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, r2, y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    }

    /// exp of eight `f32`s in place with glibc's special cases and the scalar fallback.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(lanes: &mut [f32; W256]) {
        let x = _mm256_loadu_ps(lanes.as_ptr());
        let lo = core256(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        let hi = core256(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)));
        let y = _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi);
        let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(MAY_UNDERFLOW_BOUND));
        let y = _mm256_blendv_ps(y, _mm256_set1_ps(SMALLEST_SUBNORMAL), tiny);
        let zero = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(UNDERFLOW_BOUND));
        let y = _mm256_blendv_ps(y, _mm256_setzero_ps(), zero);
        let slow = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLE_UQ>(
            x,
            _mm256_set1_ps(OVERFLOW_BOUND),
        ));
        let original = *lanes;
        _mm256_storeu_ps(lanes.as_mut_ptr(), y);
        if slow != 0 {
            for (i, (out, x)) in lanes.iter_mut().zip(original).enumerate() {
                if slow & (1 << i) != 0 {
                    *out = x.exp();
                }
            }
        }
    }

    /// [`super::exp_in_place`] with AVX2+FMA, eight lanes a step, the tail through a padded
    /// copy.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_avx2(xs: &mut [f32]) {
        let mut chunks = xs.chunks_exact_mut(W256);
        for chunk in &mut chunks {
            if let Ok(lanes) = <&mut [f32; W256]>::try_from(chunk) {
                exp8(lanes);
            }
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut lanes = [0f32; W256];
            lanes[..tail.len()].copy_from_slice(tail);
            exp8(&mut lanes);
            tail.copy_from_slice(&lanes[..tail.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exp implementation under test, named.
    type Path = (&'static str, fn(&mut [f32]));

    /// Every exp path this CPU can run, named, so each is checked on its own: the vector
    /// bodies, and the public dispatcher.
    fn paths() -> Vec<Path> {
        let mut paths = vector_paths();
        paths.push(("dispatch", exp_in_place));
        paths
    }

    /// The vector bodies this CPU can run (none on other targets).
    fn vector_paths() -> Vec<Path> {
        #[allow(unused_mut)]
        let mut paths: Vec<Path> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                paths.push(("avx512", |xs| {
                    // SAFETY: AVX-512F support was checked when this path was listed.
                    unsafe { x86::exp_avx512(xs) }
                }));
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                paths.push(("avx2", |xs| {
                    // SAFETY: AVX2 and FMA support was checked when this path was listed.
                    unsafe { x86::exp_avx2(xs) }
                }));
            }
        }
        paths
    }

    /// A disagreement with `f32::exp`: path, input, bits it gave, bits libm gave.
    type Mismatch = (&'static str, f32, u32, u32);

    /// The paths the long sweeps run: each vector body (the dispatcher only picks one of
    /// them), or the dispatcher alone where there are none.
    fn sweep_paths() -> Vec<Path> {
        let paths = vector_paths();
        if paths.is_empty() {
            self::paths()
        } else {
            paths
        }
    }

    /// Runs `paths` over `input` and records (up to 20) mismatches against `f32::exp` in `bad`.
    fn compare_block(input: &[f32], paths: &[Path], got: &mut [f32], bad: &mut Vec<Mismatch>) {
        let want: Vec<u32> = input.iter().map(|x| x.exp().to_bits()).collect();
        let got = &mut got[..input.len()];
        for (name, exp) in paths {
            got.copy_from_slice(input);
            exp(got);
            for ((x, g), w) in input.iter().zip(got.iter()).zip(&want) {
                if g.to_bits() != *w && bad.len() < 20 {
                    bad.push((*name, *x, g.to_bits(), *w));
                }
            }
        }
    }

    /// Compares the inputs `values` on the sweep paths; returns the mismatches.
    fn compare_values(values: &[f32]) -> Vec<Mismatch> {
        let mut bad = Vec::new();
        let mut got = vec![0f32; values.len()];
        compare_block(values, &sweep_paths(), &mut got, &mut bad);
        bad
    }

    /// Compares the `f32`s with bit patterns `start, start + step, …` below `end`, in blocks;
    /// returns the number of inputs compared and the mismatches.
    fn compare_bits(start: u64, end: u64, step: u64) -> (u64, Vec<Mismatch>) {
        const BLOCK: u64 = 4096;
        let paths = sweep_paths();
        let mut bad = Vec::new();
        let mut input = Vec::with_capacity(BLOCK as usize);
        let mut got = vec![0f32; BLOCK as usize];
        let mut compared = 0;
        let mut next = start;
        while next < end && bad.is_empty() {
            input.clear();
            while next < end && (input.len() as u64) < BLOCK {
                input.push(f32::from_bits(next as u32));
                next += step;
            }
            compare_block(&input, &paths, &mut got, &mut bad);
            compared += input.len() as u64;
        }
        (compared, bad)
    }

    /// [`compare_bits`] over the bit patterns `first..=last`, split across the available cores
    /// (the sweeps are long).
    fn compare_range(first: u32, last: u32) -> (u64, Vec<Mismatch>) {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4)) as u64;
        let span = u64::from(last) - u64::from(first) + 1;
        std::thread::scope(|scope| {
            let parts: Vec<_> = (0..threads)
                .map(|t| {
                    let start = u64::from(first) + span * t / threads;
                    let end = u64::from(first) + span * (t + 1) / threads;
                    scope.spawn(move || compare_bits(start, end, 1))
                })
                .collect();
            let mut compared = 0;
            let mut bad = Vec::new();
            for part in parts {
                match part.join() {
                    Ok((n, b)) => {
                        compared += n;
                        bad.extend(b);
                    }
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            (compared, bad)
        })
    }

    #[test]
    fn table_holds_powers_of_two_minus_index() {
        for (i, entry) in TABLE.iter().enumerate() {
            let power = (i as f64 / 32.0).exp2().to_bits();
            assert_eq!(*entry, power - ((i as u64) << 47), "entry {i}");
        }
    }

    /// Every `f32` from `−0.0` down to `−104.0` (past glibc's underflow bound), about
    /// 1.12 billion inputs, bit for bit against `f32::exp` on every path.
    #[test]
    #[cfg_attr(not(target_env = "gnu"), ignore = "compares with glibc's expf")]
    fn matches_libm_on_every_softmax_input() {
        let last = (-104.0f32).to_bits();
        let (compared, bad) = compare_range((-0.0f32).to_bits(), last);
        assert!(bad.is_empty(), "mismatches (path, x, got, want): {bad:?}");
        assert_eq!(compared, u64::from(last - (-0.0f32).to_bits()) + 1);
    }

    /// Beyond `−104`, positives, NaNs and infinities, sampled (every 97th bit pattern).
    #[test]
    #[cfg_attr(not(target_env = "gnu"), ignore = "compares with glibc's expf")]
    fn matches_libm_on_a_sample_of_all_other_inputs() {
        let (_, bad) = compare_bits(0, 1 << 32, 97);
        assert!(bad.is_empty(), "mismatches (path, x, got, want): {bad:?}");
    }

    #[test]
    #[cfg_attr(not(target_env = "gnu"), ignore = "compares with glibc's expf")]
    fn special_values_match_libm() {
        let specials = [
            0.0,
            -0.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MIN,
            f32::MAX,
            -f32::MIN_POSITIVE,
            -f32::from_bits(1),
            f32::from_bits(1),
            UNDERFLOW_BOUND,
            MAY_UNDERFLOW_BOUND,
            OVERFLOW_BOUND,
            f32::from_bits(UNDERFLOW_BOUND.to_bits() + 1),
            f32::from_bits(UNDERFLOW_BOUND.to_bits() - 1),
            f32::from_bits(MAY_UNDERFLOW_BOUND.to_bits() + 1),
            f32::from_bits(MAY_UNDERFLOW_BOUND.to_bits() - 1),
            f32::from_bits(OVERFLOW_BOUND.to_bits() + 1),
            -88.0,
            88.0,
            -87.5,
        ];
        let bad = compare_values(&specials);
        assert!(bad.is_empty(), "mismatches (path, x, got, want): {bad:?}");
        for (name, exp) in paths() {
            let mut xs = [f32::NEG_INFINITY, -0.0, 0.0, f32::NAN];
            exp(&mut xs);
            assert_eq!(xs[0].to_bits(), 0, "{name}: exp(−∞) is +0");
            assert_eq!(xs[1], 1.0, "{name}: exp(−0)");
            assert_eq!(xs[2], 1.0, "{name}: exp(+0)");
            assert!(xs[3].is_nan(), "{name}: exp(NaN)");
        }
    }

    /// Lengths around the vector widths, with special values placed in the tails, so masked
    /// and padded tails (and the scalar fallback inside them) are exercised.
    #[test]
    fn every_length_matches_libm() {
        for (name, exp) in paths() {
            for len in 0..=67 {
                let input: Vec<f32> = (0..len)
                    .map(|i| match i % 11 {
                        3 => f32::NAN,
                        5 => f32::NEG_INFINITY,
                        7 => 100.0,
                        _ => -(i as f32) * 1.37 - 0.01,
                    })
                    .collect();
                let mut got = input.clone();
                exp(&mut got);
                for (x, g) in input.iter().zip(&got) {
                    let want = x.exp();
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{name} len {len}: exp({x}) = {g}, libm {want}"
                    );
                }
            }
        }
    }

    /// Every `f32` bit pattern (4.3 billion) on every path. Slow (a minute or more):
    /// `cargo test --release -p wick-engine --lib exp -- --ignored`.
    #[test]
    #[ignore]
    fn matches_libm_on_every_f32() {
        let (compared, bad) = compare_range(0, u32::MAX);
        assert!(bad.is_empty(), "mismatches (path, x, got, want): {bad:?}");
        assert_eq!(compared, 1u64 << 32);
    }
}
