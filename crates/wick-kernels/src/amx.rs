//! Intel AMX (Advanced Matrix Extensions): eight tile registers of up to 16 rows × 64
//! bytes and a matrix unit that multiplies them — `tdpbssd` sums 16 × 16 × 64 signed
//! byte products into 32-bit lanes, `tdpbf16ps` 16 × 16 × 32 bf16 products into f32 —
//! in about 16 cycles each, several times the multiply-adds of AVX-512 VNNI.
//!
//! Using tiles takes three things:
//! - the CPU: CPUID leaf 7 reports AMX-TILE, AMX-INT8 and AMX-BF16 (Sapphire Rapids and
//!   later Xeons);
//! - the operating system: Linux saves the 8 KiB of tile data with a thread's state only
//!   for processes that asked (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`,
//!   Linux 5.16+); without it the first tile instruction faults. [`support`] asks once per
//!   process and remembers the answer, so a refusal (an older kernel, a sandbox) leaves
//!   the AVX-512 kernels in charge;
//! - a tile configuration per thread (`ldtilecfg`: the rows and bytes per row of each
//!   tile). Each kernel states its own ([`TileConfig`]); [`TileConfig::load`] loads it
//!   unless it is the one this thread has loaded.
//!
//! Rust's AMX intrinsics are unstable, so the instructions are written with `asm!`; the
//! tile registers are invisible to the compiler, which never reorders or drops `asm!`
//! blocks that may have side effects. The binary carries this code on every x86-64 and
//! runs it only where [`support`] said yes.
#[cfg(target_arch = "x86_64")]
use std::cell::Cell;
use std::sync::OnceLock;

/// Whether this process may run tile instructions: `Ok` once the CPU has AMX-TILE,
/// AMX-INT8, AMX-BF16 and AVX-512 BF16 and the kernel granted the tile state, else why
/// not. Asked once per process (the first call makes the request).
pub fn support() -> Result<(), &'static str> {
    static SUPPORT: OnceLock<Result<(), &'static str>> = OnceLock::new();
    *SUPPORT.get_or_init(detect)
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Result<(), &'static str> {
    Err("not an x86-64 CPU")
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Result<(), &'static str> {
    use std::arch::x86_64::__cpuid_count;
    let leaf7 = __cpuid_count(7, 0);
    let (bf16, tile, int8) = (1 << 22, 1 << 24, 1 << 25);
    if leaf7.edx & (bf16 | tile | int8) != bf16 | tile | int8 {
        return Err("the CPU has no AMX-TILE, AMX-INT8 and AMX-BF16");
    }
    if !(is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512bf16"))
    {
        return Err("the CPU (or its hypervisor) hides AVX-512 VNNI or BF16");
    }
    request_tile_state()
}

/// Asks Linux for the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, 18)`) and checks
/// that the process now holds it.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_state() -> Result<(), &'static str> {
    const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: both requests only read or change this process's permitted state
    // components; the kernel validates every argument.
    unsafe {
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) != 0
        {
            return Err("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM; kernel older than 5.16 or a sandbox)");
        }
        let mut permitted: u64 = 0;
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut permitted as *mut u64,
        ) != 0
            || permitted & (1 << XFEATURE_XTILEDATA) == 0
        {
            return Err("Linux did not grant the AMX tile state");
        }
    }
    Ok(())
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_tile_state() -> Result<(), &'static str> {
    Err("AMX tiles are used on Linux only")
}

/// A tile configuration as `ldtilecfg` reads it (palette 1): the bytes per row and rows
/// of each of the eight tiles; unused tiles stay zero.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The configuration this thread loaded last (its address; configurations are
    /// statics), so back-to-back kernel calls skip `ldtilecfg`.
    static LOADED: Cell<usize> = const { Cell::new(0) };
}

#[cfg(target_arch = "x86_64")]
impl TileConfig {
    /// Tiles `shapes[i] = (rows, bytes per row)`.
    pub(crate) const fn new(shapes: [(u8, u16); 8]) -> Self {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        let mut i = 0;
        while i < 8 {
            c.rows[i] = shapes[i].0;
            c.colsb[i] = shapes[i].1;
            i += 1;
        }
        c
    }

    /// Makes this the thread's tile configuration.
    ///
    /// # Safety
    /// [`support`] must have returned `Ok`. Every tile user of the process must load its
    /// configuration through this function (the cache of the loaded one assumes it).
    #[inline]
    pub(crate) unsafe fn load(&'static self) {
        let me = self as *const TileConfig as usize;
        if LOADED.get() != me {
            std::arch::asm!("ldtilecfg [{0}]", in(reg) me, options(nostack, readonly));
            LOADED.set(me);
        }
    }
}

/// A matrix of bf16 pairs as the left operand of [`bf16_product`]: the pair `(2j, 2j + 1)`
/// of row `i` at `data[i * stride + j]`, the first number in the low half.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Rows<'a> {
    /// The pairs.
    pub data: &'a [u32],
    /// Pairs from one row to the next.
    pub stride: usize,
}

/// A matrix of bf16 pairs as the right operand of [`bf16_product`], in groups of 16
/// columns: the pair of rows `(2p, 2p + 1)` of column `j` at
/// `data[(j / 16) * group + p * pair_stride + j % 16]`.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Columns<'a> {
    /// The pairs.
    pub data: &'a [u32],
    /// Elements from one pair of rows to the next within a group.
    pub pair_stride: usize,
    /// Elements from one group of 16 columns to the next.
    pub group: usize,
}

/// `c (m × n) = a (m × k) · b (k × n)`, or `c +=` when `accumulate`, in bf16 tiles
/// (`tdpbf16ps`: products of bf16 numbers summed in f32, denormals flushed); `c` is f32,
/// rows `ldc` apart. `m` must be a multiple of 16, `n` and `k` multiples of 32 (callers
/// run leftover rows elsewhere).
///
/// # Errors
/// When the CPU cannot run tiles ([`support`]) or a shape or buffer does not fit.
pub fn bf16_product(
    (m, n, k): (usize, usize, usize),
    a: Bf16Rows<'_>,
    b: Bf16Columns<'_>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> crate::Result<()> {
    use crate::KernelError;
    let shape = |what: &'static str, expected: usize, found: usize| {
        Err(KernelError::Shape {
            op: "bf16 tile product",
            what,
            expected,
            found,
        })
    };
    if !m.is_multiple_of(16) {
        return shape("rows (a multiple of 16)", m.next_multiple_of(16), m);
    }
    if !n.is_multiple_of(32) {
        return shape("columns (a multiple of 32)", n.next_multiple_of(32), n);
    }
    if !k.is_multiple_of(32) {
        return shape("depth (a multiple of 32)", k.next_multiple_of(32), k);
    }
    if m == 0 || n == 0 || k == 0 {
        return Ok(());
    }
    // The last element each operand is read or written at.
    let a_end = (m - 1) * a.stride + k / 2;
    let b_end = (n / 16 - 1) * b.group + (k / 2 - 1) * b.pair_stride + 16;
    let c_end = (m - 1) * ldc + n;
    if a.data.len() < a_end {
        return shape("left operand", a_end, a.data.len());
    }
    if b.data.len() < b_end {
        return shape("right operand", b_end, b.data.len());
    }
    if c.len() < c_end || ldc < n {
        return shape("result", c_end, c.len());
    }
    if let Err(why) = support() {
        return Err(KernelError::Unsupported { what: why });
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `support` said the CPU runs tiles; the checks above keep every tile row
    // that is read or written inside its buffer.
    unsafe {
        bf16_tiles((m, n, k), a, b, c.as_mut_ptr(), ldc, accumulate);
    }
    Ok(())
}

/// All tiles 16 rows × 64 bytes: 0–3 results, 4–5 left operands, 6–7 right operands.
#[cfg(target_arch = "x86_64")]
static CONFIG_BF16: TileConfig = TileConfig::new([(16, 64); 8]);

/// [`bf16_product`] past its checks: blocks of 2 × 2 result tiles (32 rows × 32 columns),
/// one of 1 × 2 for an odd last tile row.
#[cfg(target_arch = "x86_64")]
unsafe fn bf16_tiles(
    (m, n, k): (usize, usize, usize),
    a: Bf16Rows<'_>,
    b: Bf16Columns<'_>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    use std::arch::asm;
    CONFIG_BF16.load();
    let (sa, sb, sc) = (4 * a.stride, 4 * b.pair_stride, 4 * ldc);
    let steps = k / 32;
    let mut r = 0;
    while r < m {
        let two = r + 32 <= m;
        for j in (0..n).step_by(32) {
            let c0 = c.add(r * ldc + j);
            let c2 = c0.add(16 * ldc);
            if accumulate {
                asm!(
                    "tileloadd tmm0, [{c0} + {s}*1]",
                    "tileloadd tmm1, [{c1} + {s}*1]",
                    c0 = in(reg) c0, c1 = in(reg) c0.add(16), s = in(reg) sc,
                    options(nostack, readonly),
                );
                if two {
                    asm!(
                        "tileloadd tmm2, [{c0} + {s}*1]",
                        "tileloadd tmm3, [{c1} + {s}*1]",
                        c0 = in(reg) c2, c1 = in(reg) c2.add(16), s = in(reg) sc,
                        options(nostack, readonly),
                    );
                }
            } else {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
            }
            let b0 = b.data.as_ptr().add((j / 16) * b.group);
            let b1 = b0.add(b.group);
            let a0 = a.data.as_ptr().add(r * a.stride);
            for s in 0..steps {
                let (ka, kb) = (16 * s, 16 * s * b.pair_stride);
                if two {
                    asm!(
                        "tileloadd tmm4, [{a0} + {sa}*1]",
                        "tileloadd tmm5, [{a1} + {sa}*1]",
                        "tileloadd tmm6, [{b0} + {sb}*1]",
                        "tileloadd tmm7, [{b1} + {sb}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a0.add(ka),
                        a1 = in(reg) a0.add(16 * a.stride + ka),
                        b0 = in(reg) b0.add(kb),
                        b1 = in(reg) b1.add(kb),
                        sa = in(reg) sa,
                        sb = in(reg) sb,
                        options(nostack, readonly),
                    );
                } else {
                    asm!(
                        "tileloadd tmm4, [{a0} + {sa}*1]",
                        "tileloadd tmm6, [{b0} + {sb}*1]",
                        "tileloadd tmm7, [{b1} + {sb}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        a0 = in(reg) a0.add(ka),
                        b0 = in(reg) b0.add(kb),
                        b1 = in(reg) b1.add(kb),
                        sa = in(reg) sa,
                        sb = in(reg) sb,
                        options(nostack, readonly),
                    );
                }
            }
            asm!(
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                c0 = in(reg) c0, c1 = in(reg) c0.add(16), s = in(reg) sc,
                options(nostack),
            );
            if two {
                asm!(
                    "tilestored [{c0} + {s}*1], tmm2",
                    "tilestored [{c1} + {s}*1], tmm3",
                    c0 = in(reg) c2, c1 = in(reg) c2.add(16), s = in(reg) sc,
                    options(nostack),
                );
            }
        }
        r += if two { 32 } else { 16 };
    }
}
