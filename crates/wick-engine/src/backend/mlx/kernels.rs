//! wick's own CUDA kernels on the MLX GPU backend (a bf16/f16 GEMV for decode-sized
//! batches and a fused residual-add + RMS norm), and the switches that pick them.
//!
//! Each kernel is checked against MLX's own ops the first time it runs; a mismatch or a
//! compile failure switches it off for the process (logged), so a bad kernel costs speed,
//! never correctness. `WICK_MLX_KERNELS=0` turns them off, `WICK_MLX_FUSE=0` stops the
//! stacking of Q/K/V and gate/up matrices into one product.
use std::sync::atomic::{AtomicU8, Ordering};

use wick_mlx::{Array, Dtype};

use super::{mlx_err, MlxBackend};
use crate::Result;

const UNCHECKED: u8 = 0;
const GOOD: u8 = 1;
const OFF: u8 = 2;

/// Rows up to which the custom GEMV replaces MLX's matmul.
const GEMV_MAX_ROWS: i32 = 8;

/// Which optional paths the backend takes.
#[derive(Debug)]
pub(crate) struct Tuning {
    /// Stack matrices that share an input into one product.
    pub fuse: bool,
    gemv: AtomicU8,
    add_norm: AtomicU8,
}

impl std::fmt::Display for Tuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = |a: &AtomicU8| match a.load(Ordering::Relaxed) {
            GOOD => "on",
            OFF => "off",
            _ => "unchecked",
        };
        write!(
            f,
            "fuse={} gemv={} add_rms_norm={}",
            self.fuse,
            state(&self.gemv),
            state(&self.add_norm)
        )
    }
}

fn env_on(name: &str, default: bool) -> bool {
    match std::env::var(name).as_deref() {
        Ok("0") | Ok("false") | Ok("off") => false,
        Ok(_) => true,
        Err(_) => default,
    }
}

impl Tuning {
    pub(crate) fn from_env(gpu: bool) -> Self {
        let kernels = gpu && env_on("WICK_MLX_KERNELS", true);
        let initial = if kernels { UNCHECKED } else { OFF };
        Tuning {
            fuse: env_on("WICK_MLX_FUSE", true),
            gemv: AtomicU8::new(initial),
            add_norm: AtomicU8::new(initial),
        }
    }
}

/// Max |a − b| over max |b|, evaluated in f32.
fn relative_gap(be: &MlxBackend, a: &Array, b: &Array) -> Result<f32> {
    let s = be.stream();
    let a = s
        .astype(a, Dtype::F32)
        .map_err(mlx_err)?
        .to_vec::<f32>()
        .map_err(mlx_err)?;
    let b = s
        .astype(b, Dtype::F32)
        .map_err(mlx_err)?
        .to_vec::<f32>()
        .map_err(mlx_err)?;
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let gap = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    Ok(if gap.is_finite() {
        gap / scale
    } else {
        f32::INFINITY
    })
}

/// Settles an unchecked kernel: `custom` against `reference`; on a failure or a gap
/// above `tolerance` the kernel is switched off and the reference is used.
fn settle(
    be: &MlxBackend,
    state: &AtomicU8,
    what: &str,
    custom: Result<Vec<Array>>,
    reference: impl FnOnce() -> Result<Vec<Array>>,
    tolerance: f32,
) -> Result<Option<Vec<Array>>> {
    let reference = reference()?;
    let verdict = match &custom {
        Ok(c) => {
            let mut worst = 0f32;
            for (a, b) in c.iter().zip(&reference) {
                worst = worst.max(relative_gap(be, a, b)?);
            }
            if worst <= tolerance {
                Ok(worst)
            } else {
                Err(format!("differs from MLX by {worst:.2e} (relative)"))
            }
        }
        Err(e) => Err(e.to_string()),
    };
    match verdict {
        Ok(gap) => {
            state.store(GOOD, Ordering::Relaxed);
            tracing::info!("MLX custom kernel {what}: on (matches MLX within {gap:.1e})");
            Ok(custom.ok())
        }
        Err(why) => {
            state.store(OFF, Ordering::Relaxed);
            tracing::warn!("MLX custom kernel {what} switched off: {why}");
            Ok(Some(reference))
        }
    }
}

/// `x · wᵀ` for a dense `w`: the custom GEMV for decode-sized batches on the GPU,
/// MLX's matmul otherwise.
pub(crate) fn dense_product(be: &MlxBackend, t: &Tuning, x: &Array, w: &Array) -> Result<Array> {
    let s = be.stream();
    let mlx = || -> Result<Array> {
        let wt = s.transpose(w, &[1, 0]).map_err(mlx_err)?;
        s.matmul(x, &wt).map_err(mlx_err)
    };
    let rows = x.shape()[0];
    let state = t.gemv.load(Ordering::Relaxed);
    let fits = rows <= GEMV_MAX_ROWS
        && matches!(x.dtype(), Dtype::BF16 | Dtype::F16)
        && x.dtype() == w.dtype()
        && x.shape()[1] % 8 == 0;
    if state == OFF || !fits {
        return mlx();
    }
    let custom = s.gemv(x, w).map_err(mlx_err);
    if state == GOOD {
        return custom;
    }
    let out = settle(
        be,
        &t.gemv,
        "gemv",
        custom.map(|a| vec![a]),
        || Ok(vec![mlx()?]),
        2e-2,
    )?;
    match out.and_then(|mut v| v.pop()) {
        Some(a) => Ok(a),
        None => mlx(),
    }
}

/// The fused residual add + RMS norm where it applies, `None` where MLX's two ops are
/// to be used.
pub(crate) fn add_rms_norm(
    be: &MlxBackend,
    t: &Tuning,
    x: &Array,
    y: &Array,
    weight: &Array,
    eps: f32,
) -> Result<Option<(Array, Array)>> {
    let state = t.add_norm.load(Ordering::Relaxed);
    let cols = x.shape().get(1).copied().unwrap_or(0);
    let fits = matches!(x.dtype(), Dtype::BF16 | Dtype::F16)
        && y.dtype() == x.dtype()
        && weight.dtype() == x.dtype()
        && weight.size() as i32 == cols
        && cols % 8 == 0
        && cols <= 16384;
    if state == OFF || !fits {
        return Ok(None);
    }
    let s = be.stream();
    let custom = s.add_rms_norm(x, y, weight, eps).map_err(mlx_err);
    if state == GOOD {
        return custom.map(Some);
    }
    let reference = || -> Result<Vec<Array>> {
        let sum = s.add(x, y).map_err(mlx_err)?;
        let normed = s.rms_norm(&sum, weight, eps).map_err(mlx_err)?;
        Ok(vec![sum, normed])
    };
    let out = settle(
        be,
        &t.add_norm,
        "add_rms_norm",
        custom.map(|(a, b)| vec![a, b]),
        reference,
        2e-2,
    )?;
    Ok(out.and_then(|mut v| {
        let normed = v.pop()?;
        let sum = v.pop()?;
        Some((sum, normed))
    }))
}
