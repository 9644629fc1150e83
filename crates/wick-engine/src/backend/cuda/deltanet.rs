//! Qwen 3.5's gated DeltaNet on the GPU (kernels in `wick-cuda/src/deltanet.cu`): each
//! sequence's recurrent state of a layer in device memory ([`CudaDeltaState`], read back
//! only for snapshots), and the mixer of a layer over a flattened batch in one recorded
//! pass: the convolution (which also moves each convolution state on), then the delta rule
//! token by token with the gated norm for decode rows and short segments, and the chunked
//! form (64 tokens at a time) for prompt segments.
//!
//! Like attention, the launches depend only on the batch's shape: state addresses and row
//! ranges travel in uploaded arrays, so a decode step records the same work every time and
//! replays as a graph.
use std::sync::Arc;

use wick_cuda::{Arg, Buffer, Device, Kernel};

use super::{cuda_err, int, invalid, CudaBackend, CudaTensor};
use crate::backend::{
    DeltaInputs, DeltaParams, DeltaSegment, DeltaShape, DeltaState, DeltaStore, DeltaTensors,
};
use crate::{EngineError, Result};

/// Largest key and value head size the kernels take (`DN_MAX_DIM`).
const MAX_DIM: usize = 128;
/// Rows of a convolution tile (`DN_CONV_ROWS`), at least the kernel width − 1.
const CONV_ROWS: usize = 64;
/// Tokens of a chunk of the chunked form (`DN_CHUNK`).
const CHUNK: usize = 64;
/// State columns of a chunk-state block (`DN_COLS`).
const STATE_COLS: usize = 32;
/// State columns of a tensor-core chunk-state block (`DN_TC_COLS`): a 4B-shape prompt's
/// 32 value heads of 128 columns make 256 blocks.
const TC_STATE_COLS: usize = 16;
/// Threads of a tensor-core chunk-state block (`DN_TC_THREADS`).
const TC_STATE_THREADS: u32 = 128;
/// Threads of a token-by-token block (`DN_REC_THREADS`).
const RECURRENT_THREADS: u32 = 512;
/// Segments of at least this many rows take the chunked form (unless
/// `WICK_CUDA_DELTA_CHUNKED=0`); shorter ones go token by token.
pub(super) const CHUNKED_ROWS: usize = 16;

/// One sequence's state in one DeltaNet layer, in device memory: the convolution's last
/// inputs and the delta rule's per-head matrices, laid out as the host's [`DeltaState`].
/// Clones share the buffers until one of them is written (copy on write); a fresh state
/// allocates nothing until its first pass (zeros).
pub struct CudaDeltaState {
    dev: Device,
    conv_len: usize,
    ssm_len: usize,
    store: Option<Arc<DeltaBuffers>>,
}

struct DeltaBuffers {
    conv: Buffer,
    ssm: Buffer,
}

impl Clone for CudaDeltaState {
    fn clone(&self) -> Self {
        CudaDeltaState {
            dev: self.dev.clone(),
            conv_len: self.conv_len,
            ssm_len: self.ssm_len,
            store: self.store.clone(),
        }
    }
}

impl CudaDeltaState {
    pub(super) fn new(dev: Device, shape: &DeltaShape) -> Self {
        CudaDeltaState {
            dev,
            conv_len: shape.conv_state_len(),
            ssm_len: shape.ssm_state_len(),
            store: None,
        }
    }

    /// Uploads `s` (recorded: call inside a pass).
    pub(super) fn from_host(dev: Device, s: &DeltaState) -> Result<Self> {
        let upload = |v: &[f32]| -> Result<Buffer> {
            if v.is_empty() {
                dev.alloc(4).map_err(cuda_err)
            } else {
                dev.upload(bytemuck::cast_slice(v)).map_err(cuda_err)
            }
        };
        let store = DeltaBuffers {
            conv: upload(&s.conv)?,
            ssm: upload(&s.ssm)?,
        };
        Ok(CudaDeltaState {
            conv_len: s.conv.len(),
            ssm_len: s.ssm.len(),
            store: Some(Arc::new(store)),
            dev,
        })
    }

    /// The addresses of storage of this state's own (zeroed when new, a copy when shared),
    /// for a pass to update in place.
    fn writable(&mut self) -> Result<(u64, u64)> {
        let shared = self
            .store
            .as_ref()
            .is_some_and(|s| Arc::strong_count(s) > 1);
        if self.store.is_none() || shared {
            let (cb, sb) = (self.conv_len.max(1) * 4, self.ssm_len.max(1) * 4);
            let fresh = match &self.store {
                None => DeltaBuffers {
                    conv: self.dev.alloc_zeroed(cb).map_err(cuda_err)?,
                    ssm: self.dev.alloc_zeroed(sb).map_err(cuda_err)?,
                },
                Some(old) => {
                    let b = DeltaBuffers {
                        conv: self.dev.alloc(cb).map_err(cuda_err)?,
                        ssm: self.dev.alloc(sb).map_err(cuda_err)?,
                    };
                    self.dev
                        .copy(b.conv.ptr(), old.conv.ptr(), self.conv_len * 4)
                        .map_err(cuda_err)?;
                    self.dev
                        .copy(b.ssm.ptr(), old.ssm.ptr(), self.ssm_len * 4)
                        .map_err(cuda_err)?;
                    b
                }
            };
            self.store = Some(Arc::new(fresh));
        }
        let s = self
            .store
            .as_ref()
            .ok_or_else(|| EngineError::Cache("CUDA DeltaNet state missing".into()))?;
        Ok((s.conv.ptr(), s.ssm.ptr()))
    }

    fn read(&self) -> Result<DeltaState> {
        let Some(s) = &self.store else {
            return Ok(DeltaState {
                conv: vec![0.0; self.conv_len],
                ssm: vec![0.0; self.ssm_len],
            });
        };
        let read = |b: &Buffer, len: usize| -> Result<Vec<f32>> {
            let raw = self.dev.download(b.ptr(), len * 4).map_err(cuda_err)?;
            Ok(super::words(&raw))
        };
        Ok(DeltaState {
            conv: read(&s.conv, self.conv_len)?,
            ssm: read(&s.ssm, self.ssm_len)?,
        })
    }
}

impl DeltaStore for CudaDeltaState {
    fn byte_size(&self) -> usize {
        (self.conv_len + self.ssm_len) * 4
    }

    fn to_host(&self) -> DeltaState {
        self.read().unwrap_or_else(|e| {
            tracing::error!("cuda: reading a DeltaNet state to the host failed: {e}");
            DeltaState {
                conv: Vec::new(),
                ssm: Vec::new(),
            }
        })
    }
}

/// One segment as the kernels read it (`struct DeltaSeg` of `deltanet.cu`).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct DeltaSeg {
    conv: u64,
    ssm: u64,
    row0: i32,
    rows: i32,
    chunk0: i32,
    chunks: i32,
}

/// Rows of one segment (`struct DeltaTile` of `deltanet.cu`).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct DeltaTile {
    seg: i32,
    row0: i32,
    rows: i32,
    pad: i32,
}

/// What the kernels take of a layer's shape.
fn check_shape(sh: &DeltaShape) -> Result<()> {
    if sh.k_dim > MAX_DIM || sh.v_dim > MAX_DIM {
        return Err(invalid(format!(
            "DeltaNet heads of {} key and {} value dimensions: the CUDA kernels take at most {MAX_DIM}",
            sh.k_dim, sh.v_dim
        )));
    }
    if sh.k_heads == 0 || !sh.v_heads.is_multiple_of(sh.k_heads) {
        return Err(invalid(format!(
            "DeltaNet: {} value heads over {} key heads",
            sh.v_heads, sh.k_heads
        )));
    }
    if sh.conv_kernel == 0 || sh.conv_kernel > CONV_ROWS + 1 {
        return Err(invalid(format!(
            "DeltaNet convolution of width {}: the CUDA kernel takes 1 to {}",
            sh.conv_kernel,
            CONV_ROWS + 1
        )));
    }
    Ok(())
}

fn staged_ptr(b: &CudaBackend, v: &[impl bytemuck::Pod]) -> Result<u64> {
    if v.is_empty() {
        Ok(0)
    } else {
        b.stage(v)
    }
}

impl CudaBackend {
    /// [`crate::backend::Backend::delta_weights`]: the layer's vectors as they are (the
    /// convolution weight `[conv_dim][kernel]`).
    pub(super) fn delta_upload(
        &self,
        p: &DeltaParams<'_>,
    ) -> Result<Option<DeltaTensors<CudaTensor>>> {
        let sh = p.shape;
        check_shape(&sh)?;
        let up = |v: &[f32], len: usize, what: &str| -> Result<CudaTensor> {
            if v.len() != len {
                return Err(invalid(format!(
                    "DeltaNet {what}: {} values, expected {len}",
                    v.len()
                )));
            }
            self.op(|| {
                let buf = self.dev.upload(bytemuck::cast_slice(v)).map_err(cuda_err)?;
                Ok(CudaTensor {
                    buf: Arc::new(buf),
                    offset: 0,
                    rows: 1,
                    cols: len,
                    half: None,
                })
            })
        };
        Ok(Some(DeltaTensors {
            conv: up(p.conv, sh.conv_dim() * sh.conv_kernel, "convolution weight")?,
            neg_a: up(p.neg_a, sh.v_heads, "A")?,
            dt_bias: up(p.dt_bias, sh.v_heads, "dt_bias")?,
            norm: up(p.norm, sh.v_dim, "norm weight")?,
        }))
    }

    /// [`crate::backend::Backend::delta_net`] on the GPU.
    pub(super) fn delta_mix(
        &self,
        p: &DeltaParams<'_>,
        w: &DeltaTensors<CudaTensor>,
        x: DeltaInputs<'_, CudaTensor>,
        segments: &mut [DeltaSegment<'_, CudaDeltaState>],
    ) -> Result<CudaTensor> {
        let sh = p.shape;
        check_shape(&sh)?;
        let (kh, vh, kd, vd) = (sh.k_heads, sh.v_heads, sh.k_dim, sh.v_dim);
        let (cd, vt) = (sh.conv_dim(), vh * vd);
        let n = x.qkv.rows;
        for (t, cols, what) in [
            (x.qkv, cd, "qkv"),
            (x.z, vt, "z"),
            (x.b, vh, "b"),
            (x.a, vh, "a"),
        ] {
            if t.rows != n || t.cols != cols {
                return Err(invalid(format!(
                    "delta_net: {what} is {}x{}, expected {n}x{cols}",
                    t.rows, t.cols
                )));
            }
        }
        if w.conv.len() != cd * sh.conv_kernel || w.neg_a.len() != vh || w.norm.len() != vd {
            return Err(invalid(
                "delta_net: the layer's weights are of another shape".into(),
            ));
        }
        let mut end = 0;
        for s in segments.iter() {
            if s.rows.start < end || s.rows.end > n || s.rows.start > s.rows.end {
                return Err(invalid(format!(
                    "delta_net: segment rows {:?} of {n} (after {end})",
                    s.rows
                )));
            }
            end = s.rows.end;
            if s.state.conv_len != sh.conv_state_len() || s.state.ssm_len != sh.ssm_state_len() {
                return Err(EngineError::Cache(
                    "delta_net: a state of another layer shape".into(),
                ));
            }
        }
        let (ikh, ivh, ikd, ivd) = (
            int(kh, "key heads")?,
            int(vh, "value heads")?,
            int(kd, "key size")?,
            int(vd, "value size")?,
        );
        let scale = (kd as f32).powf(-0.5);
        self.op(|| {
            let out = self.tensor(n, vt)?;
            let mixed = self.tensor(n, cd)?;
            let mut segs = Vec::with_capacity(segments.len());
            let (mut conv_tiles, mut chunk_tiles) = (Vec::new(), Vec::new());
            let (mut short, mut long) = (Vec::new(), Vec::new());
            for s in segments.iter_mut() {
                let rows = s.rows.len();
                if rows == 0 {
                    continue;
                }
                let (conv, ssm) = s.state.writable()?;
                let idx = int(segs.len(), "segments")?;
                let chunked = self.delta_chunked && rows >= CHUNKED_ROWS;
                let chunk0 = chunk_tiles.len();
                if chunked {
                    for r0 in s.rows.clone().step_by(CHUNK) {
                        chunk_tiles.push(DeltaTile {
                            seg: idx,
                            row0: int(r0, "row")?,
                            rows: (s.rows.end - r0).min(CHUNK) as i32,
                            pad: 0,
                        });
                    }
                    long.push(idx);
                } else {
                    short.push(idx);
                }
                for r0 in s.rows.clone().step_by(CONV_ROWS) {
                    conv_tiles.push(DeltaTile {
                        seg: idx,
                        row0: int(r0, "row")?,
                        rows: (s.rows.end - r0).min(CONV_ROWS) as i32,
                        pad: 0,
                    });
                }
                segs.push(DeltaSeg {
                    conv,
                    ssm,
                    row0: int(s.rows.start, "row")?,
                    rows: int(rows, "rows")?,
                    chunk0: int(chunk0, "chunks")?,
                    chunks: int(chunk_tiles.len() - chunk0, "chunks")?,
                });
            }
            if segs.is_empty() {
                return Ok(out);
            }
            let segs_dev = staged_ptr(self, &segs)?;
            let conv_dev = staged_ptr(self, &conv_tiles)?;
            self.launch(
                Kernel::DeltaConv,
                (conv_tiles.len() as u32, cd.div_ceil(256) as u32, 1),
                256,
                &[
                    Arg::Ptr(x.qkv.ptr()),
                    Arg::Ptr(mixed.ptr()),
                    Arg::Ptr(w.conv.ptr()),
                    Arg::Ptr(segs_dev),
                    Arg::Ptr(conv_dev),
                    Arg::I32(int(cd, "channels")?),
                    Arg::I32(int(sh.conv_kernel, "kernel")?),
                ],
            )?;
            if !short.is_empty() {
                let list = staged_ptr(self, &short)?;
                self.launch(
                    Kernel::DeltaRecurrent,
                    (short.len() as u32, vh as u32, 1),
                    RECURRENT_THREADS,
                    &[
                        Arg::Ptr(mixed.ptr()),
                        Arg::Ptr(x.z.ptr()),
                        Arg::Ptr(x.b.ptr()),
                        Arg::Ptr(x.a.ptr()),
                        Arg::Ptr(out.ptr()),
                        Arg::Ptr(segs_dev),
                        Arg::Ptr(list),
                        Arg::Ptr(w.neg_a.ptr()),
                        Arg::Ptr(w.dt_bias.ptr()),
                        Arg::Ptr(w.norm.ptr()),
                        Arg::I32(ikh),
                        Arg::I32(ivh),
                        Arg::I32(ikd),
                        Arg::I32(ivd),
                        Arg::F32(scale),
                        Arg::F32(p.eps),
                    ],
                )?;
            }
            if !long.is_empty() {
                let tiles = chunk_tiles.len();
                let list = staged_ptr(self, &long)?;
                let tiles_dev = staged_ptr(self, &chunk_tiles)?;
                let scratch = |floats: usize| self.dev.alloc(floats * 4).map_err(cuda_err);
                let (g, beta, gc) = (scratch(n * vh)?, scratch(n * vh)?, scratch(n * vh)?);
                let (wm, um) = (scratch(n * vh * kd)?, scratch(n * vt)?);
                let pm = scratch(tiles * vh * CHUNK * CHUNK)?;
                let o = scratch(n * vt)?;
                self.launch(
                    Kernel::DeltaPrep,
                    (tiles as u32, kh as u32, 1),
                    128,
                    &[
                        Arg::Ptr(mixed.ptr()),
                        Arg::Ptr(x.b.ptr()),
                        Arg::Ptr(x.a.ptr()),
                        Arg::Ptr(g.ptr()),
                        Arg::Ptr(beta.ptr()),
                        Arg::Ptr(tiles_dev),
                        Arg::Ptr(w.neg_a.ptr()),
                        Arg::Ptr(w.dt_bias.ptr()),
                        Arg::I32(ikh),
                        Arg::I32(ivh),
                        Arg::I32(ikd),
                        Arg::I32(ivd),
                        Arg::F32(scale),
                    ],
                )?;
                self.launch(
                    Kernel::DeltaChunkPrep,
                    (tiles as u32, vh as u32, 1),
                    256,
                    &[
                        Arg::Ptr(mixed.ptr()),
                        Arg::Ptr(g.ptr()),
                        Arg::Ptr(beta.ptr()),
                        Arg::Ptr(gc.ptr()),
                        Arg::Ptr(wm.ptr()),
                        Arg::Ptr(um.ptr()),
                        Arg::Ptr(pm.ptr()),
                        Arg::Ptr(tiles_dev),
                        Arg::I32(ikh),
                        Arg::I32(ivh),
                        Arg::I32(ikd),
                        Arg::I32(ivd),
                    ],
                )?;
                let (state, cols, threads) = if self.delta_mma {
                    (Kernel::DeltaChunkStateTc, TC_STATE_COLS, TC_STATE_THREADS)
                } else {
                    (Kernel::DeltaChunkState, STATE_COLS, 256)
                };
                self.launch(
                    state,
                    (long.len() as u32, vh as u32, vd.div_ceil(cols) as u32),
                    threads,
                    &[
                        Arg::Ptr(mixed.ptr()),
                        Arg::Ptr(gc.ptr()),
                        Arg::Ptr(wm.ptr()),
                        Arg::Ptr(um.ptr()),
                        Arg::Ptr(pm.ptr()),
                        Arg::Ptr(o.ptr()),
                        Arg::Ptr(segs_dev),
                        Arg::Ptr(list),
                        Arg::Ptr(tiles_dev),
                        Arg::I32(ikh),
                        Arg::I32(ivh),
                        Arg::I32(ikd),
                        Arg::I32(ivd),
                    ],
                )?;
                self.launch(
                    Kernel::DeltaGatedNorm,
                    (tiles as u32, vh as u32, 1),
                    128,
                    &[
                        Arg::Ptr(o.ptr()),
                        Arg::Ptr(x.z.ptr()),
                        Arg::Ptr(w.norm.ptr()),
                        Arg::Ptr(out.ptr()),
                        Arg::Ptr(tiles_dev),
                        Arg::I32(ivh),
                        Arg::I32(ivd),
                        Arg::F32(p.eps),
                    ],
                )?;
            }
            Ok(out)
        })
    }
}
