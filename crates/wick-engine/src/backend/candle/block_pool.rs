//! Block storage of the CPU backend's KV cache: every layer of every sequence stores its
//! keys and values in [`KvBlock`]s of [`BLOCK_TOKENS`] tokens, in the cache's number type
//! ([`KvDtype`]). Counting and charging blocks is backend-neutral and lives in
//! [`crate::kv_pool`].
//!
//! A block is an `Arc`: a cloned cache shares its full blocks with the original and copies
//! one only when it writes to it (copy-on-write, `Arc::make_mut`). That is the hook the
//! prefix cache uses to share a common prompt prefix between sequences.
use half::f16;

pub use crate::kv_pool::{block_bytes, BLOCK_TOKENS};

/// How the CPU KV cache stores keys and values.
///
/// `F16` (llama.cpp's default) halves the bytes that batched decode attention streams
/// from memory; every stored number is rounded to the nearest half, and attention computes
/// in f32 on the converted values. `F32` keeps the activations exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// 32-bit floats.
    #[default]
    F32,
    /// IEEE half precision.
    F16,
}

impl KvDtype {
    /// The name `--kv-type` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }

    /// Bytes of one stored number.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "half" => Ok(KvDtype::F16),
            other => Err(format!("unknown KV type `{other}` (expected f32 or f16)")),
        }
    }
}

/// The numbers of one block's keys or values, in the cache's [`KvDtype`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum KvData {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl KvData {
    fn zeroed(dtype: KvDtype, n: usize) -> Self {
        match dtype {
            KvDtype::F32 => KvData::F32(vec![0.0; n]),
            KvDtype::F16 => KvData::F16(vec![f16::ZERO; n]),
        }
    }

    #[inline]
    fn set(&mut self, i: usize, x: f32) {
        match self {
            KvData::F32(d) => d[i] = x,
            KvData::F16(d) => d[i] = f16::from_f32(x),
        }
    }

    #[inline]
    fn get(&self, i: usize) -> f32 {
        match self {
            KvData::F32(d) => d[i],
            KvData::F16(d) => d[i].to_f32(),
        }
    }

    /// Starts loading elements `range` into the CPU caches.
    #[inline]
    fn prefetch(&self, range: std::ops::Range<usize>) {
        match self {
            KvData::F32(d) => prefetch(&d[range]),
            KvData::F16(d) => prefetch(&d[range]),
        }
    }
}

/// A number type KV blocks store, which attention reads as f32 sixteen at a time: the
/// conversion happens in registers, next to the products that use it, so a block is read
/// from memory once and never copied. Half to f32 is exact, so every instruction set
/// ([`Simd`]) gives the same bits.
pub(crate) trait KvNumber: Copy {
    /// `data`'s numbers when they are of this type.
    fn of(data: &KvData) -> Option<&[Self]>;

    /// The first sixteen numbers of `src` as f32, converted with `simd`'s instructions.
    fn load16<S: Simd>(simd: S, src: &[Self]) -> [f32; 16];

    /// One number as f32.
    fn to_f32(self) -> f32;
}

impl KvNumber for f32 {
    #[inline(always)]
    fn of(data: &KvData) -> Option<&[f32]> {
        match data {
            KvData::F32(d) => Some(d),
            KvData::F16(_) => None,
        }
    }

    #[inline(always)]
    fn load16<S: Simd>(_: S, src: &[f32]) -> [f32; 16] {
        src[..16].try_into().expect("sixteen numbers")
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvNumber for f16 {
    #[inline(always)]
    fn of(data: &KvData) -> Option<&[f16]> {
        match data {
            KvData::F16(d) => Some(d),
            KvData::F32(_) => None,
        }
    }

    #[inline(always)]
    fn load16<S: Simd>(simd: S, src: &[f16]) -> [f32; 16] {
        simd.f16x16(src[..16].try_into().expect("sixteen numbers"))
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// An instruction set the CPU was found to have, as a zero-sized proof: a value exists only
/// where the CPU runs the set's instructions, so kernels generic over it are instantiated
/// once per set and may use them. The set is chosen at run time; nothing here depends on
/// the build's target features.
pub(crate) trait Simd: Copy {
    /// Sixteen halves as f32 (exact).
    fn f16x16(self, src: &[f16; 16]) -> [f32; 16];
}

/// Any CPU: the conversions are portable code.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Portable;

impl Simd for Portable {
    #[inline(always)]
    fn f16x16(self, src: &[f16; 16]) -> [f32; 16] {
        use half::slice::HalfFloatSliceExt;
        let mut out = [0f32; 16];
        src.convert_to_f32_slice(&mut out);
        out
    }
}

/// x86-64 with AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2(());

#[cfg(target_arch = "x86_64")]
impl Avx2 {
    /// The proof, when this CPU has the set.
    pub(crate) fn detect() -> Option<Self> {
        let has = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        has.then_some(Avx2(()))
    }
}

#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
    #[inline(always)]
    fn f16x16(self, src: &[f16; 16]) -> [f32; 16] {
        /// # Safety
        /// The CPU must have F16C (and AVX).
        #[target_feature(enable = "avx,f16c")]
        #[inline]
        unsafe fn convert(src: &[f16; 16]) -> [f32; 16] {
            use std::arch::x86_64::{_mm256_cvtph_ps, _mm_loadu_si128};
            // SAFETY: the loads read the 32 bytes of `src`, unaligned.
            unsafe {
                let lo = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().cast()));
                let hi = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(8).cast()));
                std::mem::transmute::<[std::arch::x86_64::__m256; 2], [f32; 16]>([lo, hi])
            }
        }
        // SAFETY: an `Avx2` exists only where the CPU has F16C (`Avx2::detect`).
        unsafe { convert(src) }
    }
}

/// x86-64 with AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512(());

#[cfg(target_arch = "x86_64")]
impl Avx512 {
    /// The proof, when this CPU has the set.
    pub(crate) fn detect() -> Option<Self> {
        let has = Avx2::detect().is_some()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl");
        has.then_some(Avx512(()))
    }
}

#[cfg(target_arch = "x86_64")]
impl Simd for Avx512 {
    #[inline(always)]
    fn f16x16(self, src: &[f16; 16]) -> [f32; 16] {
        /// # Safety
        /// The CPU must have AVX-512F.
        #[target_feature(enable = "avx512f")]
        #[inline]
        unsafe fn convert(src: &[f16; 16]) -> [f32; 16] {
            use std::arch::x86_64::{_mm256_loadu_si256, _mm512_cvtph_ps};
            // SAFETY: the load reads the 32 bytes of `src`, unaligned.
            unsafe {
                let halves = _mm256_loadu_si256(src.as_ptr().cast());
                std::mem::transmute::<std::arch::x86_64::__m512, [f32; 16]>(_mm512_cvtph_ps(halves))
            }
        }
        // SAFETY: an `Avx512` exists only where the CPU has AVX-512F (`Avx512::detect`).
        unsafe { convert(src) }
    }
}

/// Asks the CPU to start loading `data` into its caches: blocks are separate allocations,
/// so the hardware prefetcher stops at each block's end and a decode step's KV reads
/// would come from memory one miss at a time. A hint only; it never faults.
#[inline(always)]
fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = data.as_ptr().cast::<i8>();
        for offset in (0..std::mem::size_of_val(data)).step_by(64) {
            // SAFETY: a prefetch hint reads nothing architecturally and cannot fault; the
            // address is inside `data` anyway.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    start.add(offset),
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Keys and values of [`BLOCK_TOKENS`] consecutive tokens of one layer.
///
/// Keys are stored transposed, `[kv_head][dim][slot]`, so attention computes the scores
/// of a whole block as sixteen-wide vector products with no horizontal sums; values are
/// head-major, `[kv_head][slot][dim]`, so the rows one head adds up are contiguous. Slots
/// past the layer's length hold stale or zero data and are never read.
#[derive(Debug, Clone, PartialEq)]
pub struct KvBlock {
    keys: KvData,
    values: KvData,
}

impl KvBlock {
    /// A zeroed block for tokens of `row` numbers.
    pub(crate) fn with_row(row: usize, dtype: KvDtype) -> Self {
        KvBlock {
            keys: KvData::zeroed(dtype, BLOCK_TOKENS * row),
            values: KvData::zeroed(dtype, BLOCK_TOKENS * row),
        }
    }

    /// Stores one token's keys and values (`[kv_head][head_dim]` each) in `slot`.
    #[inline]
    pub(crate) fn write(&mut self, slot: usize, head_dim: usize, keys: &[f32], values: &[f32]) {
        for (i, &k) in keys.iter().enumerate() {
            self.keys.set(i * BLOCK_TOKENS + slot, k);
        }
        for (h, v) in values.chunks_exact(head_dim).enumerate() {
            let at = (h * BLOCK_TOKENS + slot) * head_dim;
            for (d, &x) in v.iter().enumerate() {
                self.values.set(at + d, x);
            }
        }
    }

    /// Appends the keys and values of `slot` (`[kv_head][head_dim]`, `row` numbers) to
    /// `keys` and `values`.
    pub(crate) fn read(
        &self,
        slot: usize,
        row: usize,
        head_dim: usize,
        keys: &mut Vec<f32>,
        values: &mut Vec<f32>,
    ) {
        keys.extend((0..row).map(|i| self.keys.get(i * BLOCK_TOKENS + slot)));
        values.extend((0..row).map(|i| {
            let (h, d) = (i / head_dim, i % head_dim);
            self.values.get((h * BLOCK_TOKENS + slot) * head_dim + d)
        }));
    }

    fn head_range(h: usize, head_dim: usize) -> std::ops::Range<usize> {
        h * head_dim * BLOCK_TOKENS..(h + 1) * head_dim * BLOCK_TOKENS
    }

    /// Transposed keys of KV head `h`, `[dim][slot]`, as stored (`E` is the cache's
    /// number type).
    #[inline]
    pub(crate) fn head_keys<E: KvNumber>(&self, h: usize, head_dim: usize) -> &[E] {
        &Self::numbers(&self.keys)[Self::head_range(h, head_dim)]
    }

    /// `data` as numbers of type `E`, the type every block of a cache stores.
    #[inline(always)]
    fn numbers<E: KvNumber>(data: &KvData) -> &[E] {
        E::of(data).expect("attention reads a block as the KV type of its cache")
    }

    /// Starts loading the keys of KV head `h`.
    #[inline]
    pub(crate) fn prefetch_head_keys(&self, h: usize, head_dim: usize) {
        self.keys.prefetch(Self::head_range(h, head_dim));
    }

    /// Values of KV head `h` for slots `slots`, `[slot][dim]`, as stored.
    #[inline]
    pub(crate) fn head_values<E: KvNumber>(
        &self,
        h: usize,
        head_dim: usize,
        slots: std::ops::Range<usize>,
    ) -> &[E] {
        let at = h * BLOCK_TOKENS * head_dim;
        &Self::numbers(&self.values)[at + slots.start * head_dim..at + slots.end * head_dim]
    }

    /// Starts loading the values of KV head `h`.
    #[inline]
    pub(crate) fn prefetch_head_values(&self, h: usize, head_dim: usize) {
        self.values.prefetch(Self::head_range(h, head_dim));
    }
}
