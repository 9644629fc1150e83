//! [`matmul`]: `out = x · wᵀ (+ bias)` for one or several packed matrices sharing the
//! input, spread over a [`ThreadPool`].
//!
//! The input is quantized once (when any matrix is quantized) and every matrix's strips
//! become work units taken from one atomic counter, so q/k/v or gate/up projections run
//! as a single parallel section. Nothing is allocated: the quantized input lives in the
//! caller's [`QuantizedActivations`].
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::kernels::{self, Output};
use crate::{Isa, KernelError, PackedMatrix, QuantizedActivations, Result, ThreadPool};

/// One matrix of a [`matmul`] call and where its product goes.
#[derive(Debug)]
pub struct Product<'a> {
    /// `[rows, cols]` weights.
    pub weight: &'a PackedMatrix,
    /// `[n, rows]` output, overwritten.
    pub out: &'a mut [f32],
    /// `rows` values added to every output row.
    pub bias: Option<&'a [f32]>,
}

/// Most matrices one call takes.
pub const MAX_PRODUCTS: usize = 8;

/// Multiply-adds under which a call stays on the calling thread.
const SERIAL_WORK: usize = 1 << 16;
/// Tokens per chunk of a long input (64 rows of activations fit in L2 for any width
/// of the supported models).
const TOKEN_CHUNK: usize = 64;
/// Tokens per chunk on AMX: each unit unpacks its strips' codes once for the tile
/// products of all its tokens, so longer chunks unpack less (128 rows still fit in L2).
const AMX_TOKEN_CHUNK: usize = 128;
/// Activation elements under which quantization stays on the calling thread.
const SERIAL_QUANTIZE: usize = 1 << 15;

/// Computes every product of `x` (`n × cols`, row-major) with the matrices of
/// `products`, which must all have `cols` columns.
pub fn matmul(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    n: usize,
    products: &mut [Product<'_>],
    act: &mut QuantizedActivations,
) -> Result<()> {
    let Some(first) = products.first() else {
        return Ok(());
    };
    if products.len() > MAX_PRODUCTS {
        return Err(KernelError::Shape {
            op: "matmul",
            what: "product list",
            expected: MAX_PRODUCTS,
            found: products.len(),
        });
    }
    let cols = first.weight.cols();
    for p in products.iter() {
        let w = p.weight;
        if w.cols() != cols {
            return Err(KernelError::MixedColumns {
                first: cols,
                other: w.cols(),
            });
        }
        check("output", n * w.rows(), p.out.len())?;
        if let Some(b) = p.bias {
            check("bias", w.rows(), b.len())?;
        }
    }
    check("input", n * cols, x.len())?;
    if n == 0 {
        return Ok(());
    }

    if products.iter().any(|p| p.weight.format().is_quantized()) {
        quantize(pool, isa, x, n, cols, act);
    }
    let act = &*act;

    // Work units: runs of `group` strips of one matrix, numbered across matrices.
    // Batched decode (a few tokens) tiles up to four strips at once, so its units are as
    // wide as single-token decode's; long inputs keep narrow units for balance.
    let group = if n <= 8 { 8 } else { 2 };
    let mut outputs = [None; MAX_PRODUCTS];
    let mut first_unit = [0usize; MAX_PRODUCTS + 1];
    let mut macs = 0usize;
    for (i, p) in products.iter_mut().enumerate() {
        let w = p.weight;
        outputs[i] = Some(Output {
            ptr: p.out.as_mut_ptr(),
            ld: w.rows(),
            rows: w.rows(),
            bias: p.bias.map_or(std::ptr::null(), |b| b.as_ptr()),
        });
        first_unit[i + 1] = first_unit[i] + w.strips().div_ceil(group);
        macs += n * w.rows() * cols;
    }
    let count = products.len();
    // Long inputs are cut into chunks of tokens, units numbered chunk by chunk, so a
    // thread's consecutive units reuse one chunk of activations from its cache.
    let per_chunk = first_unit[count];
    let chunk_tokens = if isa == Isa::Amx {
        AMX_TOKEN_CHUNK
    } else {
        TOKEN_CHUNK
    };
    let chunks = n.div_ceil(chunk_tokens);
    let units = per_chunk * chunks;
    let weights: [Option<&PackedMatrix>; MAX_PRODUCTS] =
        std::array::from_fn(|i| products.get(i).map(|p| p.weight));
    let next = AtomicUsize::new(0);
    let work = |_thread: usize| loop {
        let u = next.fetch_add(1, Ordering::Relaxed);
        if u >= units {
            break;
        }
        let (chunk, u) = (u / per_chunk, u % per_chunk);
        let tokens = chunk * chunk_tokens..((chunk + 1) * chunk_tokens).min(n);
        let i = (0..count).rfind(|&i| first_unit[i] <= u).unwrap_or(0);
        let (Some(w), Some(out)) = (weights[i], outputs[i]) else {
            continue;
        };
        let s0 = (u - first_unit[i]) * group;
        let strips = s0..(s0 + group).min(w.strips());
        // SAFETY: each unit owns distinct strips (rows) of its output, which `check`
        // sized for `n` tokens; `act`/`x` hold `n` rows of `cols`.
        unsafe {
            if w.format().is_quantized() {
                kernels::quantized(isa, w, strips, act, tokens, out);
            } else {
                kernels::float(isa, w, strips, x, tokens, out);
            }
        }
    };
    if macs < SERIAL_WORK {
        work(0);
    } else {
        pool.run(&work);
    }
    Ok(())
}

fn check(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected != found {
        return Err(KernelError::Shape {
            op: "matmul",
            what,
            expected,
            found,
        });
    }
    Ok(())
}

/// Quantizes `x` into `act`, rows spread over the pool when there are many.
fn quantize(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    n: usize,
    cols: usize,
    act: &mut QuantizedActivations,
) {
    // The AMX kernels read the scales of each tile of tokens as one run.
    let writer = act.prepare(n, cols, isa == Isa::Amx);
    if n * cols < SERIAL_QUANTIZE || n == 1 {
        // SAFETY: `prepare` sized the buffers for `n × cols`.
        unsafe { writer.rows(isa, x, 0..n) };
        return;
    }
    let chunk = n.div_ceil(pool.threads() * 4).max(1);
    let next = AtomicUsize::new(0);
    pool.run(&|_| loop {
        let r0 = next.fetch_add(chunk, Ordering::Relaxed);
        if r0 >= n {
            break;
        }
        // SAFETY: disjoint row ranges of buffers sized by `prepare`.
        unsafe { writer.rows(isa, x, r0..(r0 + chunk).min(n)) };
    });
}
