//! Qwen 3.5's gated DeltaNet on MLX (where the backend runs it as MLX ops, see
//! [`DeltaNetPlace`]): each sequence's recurrent state of a layer as MLX arrays
//! ([`MlxDeltaState`], read back only for snapshots), and the mixer of a layer over
//! a flattened batch as MLX ops (`Stream::gated_delta`: the causal convolution continuing
//! its state, the normalized queries and keys, the delta rule, the gated norm), so a step
//! stays one lazy graph on the device. Sequences decoding one row each go through the
//! token-by-token form together, their states stacked; a prompt segment of
//! [`CHUNKED_ROWS`] rows or more takes the chunked form alone.
use wick_mlx::{Array, DeltaStates, Dtype, GatedDelta};

use super::{mlx_err, DeltaNetPlace, MlxBackend};
use crate::backend::{
    DeltaInputs, DeltaParams, DeltaSegment, DeltaShape, DeltaState, DeltaStore, DeltaTensors,
};
use crate::{EngineError, Result};

/// Segments of at least this many rows take the chunked form (64 tokens a chunk); shorter
/// ones go token by token.
pub(crate) const CHUNKED_ROWS: usize = 16;

/// One sequence's state in one DeltaNet layer: the convolution's last inputs
/// `[1, kernel - 1, conv_dim]` and the delta rule's matrices `[1, v_heads, k_dim, v_dim]`,
/// float32; a fresh state holds nothing until its first pass (zeros). MLX arrays are
/// values: a clone shares them, and a pass replaces a state's arrays with new ones instead
/// of writing into them, so a clone never sees another's tokens. Where the backend mixes
/// on the host the state is a host [`DeltaState`] instead.
#[derive(Debug, Clone)]
pub struct MlxDeltaState {
    host: Option<DeltaState>,
    states: Option<DeltaStates>,
    conv_len: usize,
    ssm_len: usize,
}

fn invalid(message: String) -> EngineError {
    EngineError::Backend {
        backend: "mlx",
        message,
    }
}

fn conv_shape(sh: &DeltaShape) -> [i32; 3] {
    [1, sh.conv_kernel as i32 - 1, sh.conv_dim() as i32]
}

fn ssm_shape(sh: &DeltaShape) -> [i32; 4] {
    [1, sh.v_heads as i32, sh.k_dim as i32, sh.v_dim as i32]
}

impl MlxDeltaState {
    /// The zero state of a layer of `shape`.
    pub(crate) fn new(shape: &DeltaShape, place: DeltaNetPlace) -> Self {
        MlxDeltaState {
            host: (place == DeltaNetPlace::Host).then(|| DeltaState::new(shape)),
            states: None,
            conv_len: shape.conv_state_len(),
            ssm_len: shape.ssm_state_len(),
        }
    }

    /// A state holding the host copy `h` (on the device laid out flat until a pass gives
    /// it its shape).
    pub(crate) fn from_host(h: DeltaState, place: DeltaNetPlace) -> Result<Self> {
        let (conv_len, ssm_len) = (h.conv.len(), h.ssm.len());
        if place == DeltaNetPlace::Host {
            return Ok(MlxDeltaState {
                host: Some(h),
                states: None,
                conv_len,
                ssm_len,
            });
        }
        Ok(MlxDeltaState {
            host: None,
            states: Some(DeltaStates {
                conv: Array::from_slice(&h.conv, &[conv_len as i32]).map_err(mlx_err)?,
                ssm: Array::from_slice(&h.ssm, &[ssm_len as i32]).map_err(mlx_err)?,
            }),
            conv_len,
            ssm_len,
        })
    }

    fn read(&self) -> Result<DeltaState> {
        if let Some(h) = &self.host {
            return Ok(h.clone());
        }
        Ok(match &self.states {
            None => DeltaState {
                conv: vec![0.0; self.conv_len],
                ssm: vec![0.0; self.ssm_len],
            },
            Some(st) => DeltaState {
                conv: st.conv.to_vec::<f32>().map_err(mlx_err)?,
                ssm: st.ssm.to_vec::<f32>().map_err(mlx_err)?,
            },
        })
    }

    /// The state in the shapes of a layer of `sh`, checked against them.
    fn shaped(&self, be: &MlxBackend, sh: &DeltaShape) -> Result<DeltaStates> {
        if self.conv_len != sh.conv_state_len() || self.ssm_len != sh.ssm_state_len() {
            return Err(invalid(format!(
                "a DeltaNet state of {} + {} values does not fit a layer of {} + {}",
                self.conv_len,
                self.ssm_len,
                sh.conv_state_len(),
                sh.ssm_state_len()
            )));
        }
        let s = be.stream();
        if let Some(h) = &self.host {
            // A host state met by the device form: uploaded.
            let up = |v: &[f32]| Array::from_slice(v, &[v.len() as i32]).map_err(mlx_err);
            return Ok(DeltaStates {
                conv: s.reshape(&up(&h.conv)?, &conv_shape(sh)).map_err(mlx_err)?,
                ssm: s.reshape(&up(&h.ssm)?, &ssm_shape(sh)).map_err(mlx_err)?,
            });
        }
        Ok(match &self.states {
            None => DeltaStates {
                conv: s.zeros(&conv_shape(sh), Dtype::F32).map_err(mlx_err)?,
                ssm: s.zeros(&ssm_shape(sh), Dtype::F32).map_err(mlx_err)?,
            },
            Some(st) => DeltaStates {
                conv: s.reshape(&st.conv, &conv_shape(sh)).map_err(mlx_err)?,
                ssm: s.reshape(&st.ssm, &ssm_shape(sh)).map_err(mlx_err)?,
            },
        })
    }
}

impl DeltaStore for MlxDeltaState {
    fn byte_size(&self) -> usize {
        (self.conv_len + self.ssm_len) * 4
    }

    fn to_host(&self) -> DeltaState {
        self.read().unwrap_or_else(|e| {
            tracing::error!("mlx: reading a DeltaNet state to the host failed: {e}");
            DeltaState {
                conv: Vec::new(),
                ssm: Vec::new(),
            }
        })
    }

    fn host_mut(&mut self) -> Option<&mut DeltaState> {
        self.host.as_mut()
    }
}

/// Uploads a layer's vectors in float32 (the convolution weight as `[conv_dim, kernel]`).
pub(crate) fn weights(p: &DeltaParams<'_>) -> Result<DeltaTensors<Array>> {
    let sh = p.shape;
    let vector = |v: &[f32]| Array::from_slice(v, &[v.len() as i32]).map_err(mlx_err);
    if p.conv.len() != sh.conv_dim() * sh.conv_kernel
        || p.neg_a.len() != sh.v_heads
        || p.dt_bias.len() != sh.v_heads
        || p.norm.len() != sh.v_dim
    {
        return Err(invalid(
            "DeltaNet weights do not fit the layer's shape".into(),
        ));
    }
    Ok(DeltaTensors {
        conv: Array::from_slice(p.conv, &[sh.conv_dim() as i32, sh.conv_kernel as i32])
            .map_err(mlx_err)?,
        neg_a: vector(p.neg_a)?,
        dt_bias: vector(p.dt_bias)?,
        norm: vector(p.norm)?,
    })
}

/// [`crate::backend::Backend::delta_net`] on MLX (see the module docs). The segments cover
/// the batch's rows in order.
pub(crate) fn mix(
    be: &MlxBackend,
    p: &DeltaParams<'_>,
    w: &DeltaTensors<Array>,
    x: DeltaInputs<'_, Array>,
    segments: &mut [DeltaSegment<'_, MlxDeltaState>],
) -> Result<Array> {
    let s = be.stream();
    let sh = p.shape;
    let mut at = 0;
    for seg in segments.iter() {
        if seg.rows.start != at {
            return Err(invalid(format!(
                "DeltaNet segments must cover the batch in order: rows {:?} after {at}",
                seg.rows
            )));
        }
        at = seg.rows.end;
    }
    let run = |rows: &[usize], m: usize, states: &DeltaStates, chunked: bool| -> Result<_> {
        let pick = |t: &Array| -> Result<Array> {
            let t = if rows.len() * m == at {
                t.clone()
            } else if m == 1 {
                let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                let idx = Array::from_slice(&idx, &[idx.len() as i32]).map_err(mlx_err)?;
                s.take(t, &idx, 0).map_err(mlx_err)?
            } else {
                let cols = t.shape()[1];
                let r = rows[0] as i32;
                s.slice(t, &[r, 0], &[r + m as i32, cols])
                    .map_err(mlx_err)?
            };
            let cols = t.shape()[1];
            s.reshape(&t, &[rows.len() as i32, m as i32, cols])
                .map_err(mlx_err)
        };
        let (qkv, z, b, a) = (pick(x.qkv)?, pick(x.z)?, pick(x.b)?, pick(x.a)?);
        s.gated_delta(&GatedDelta {
            qkv: &qkv,
            z: &z,
            b: &b,
            a: &a,
            states,
            conv_weight: &w.conv,
            neg_a: &w.neg_a,
            dt_bias: &w.dt_bias,
            norm: &w.norm,
            heads: (sh.k_heads, sh.v_heads),
            dims: (sh.k_dim, sh.v_dim),
            eps: p.eps,
            chunked,
        })
        .map_err(mlx_err)
    };
    let vd = (sh.v_heads * sh.v_dim) as i32;
    // Each segment's output rows, in batch order once sorted by first row.
    let mut outs: Vec<(usize, Array)> = Vec::with_capacity(segments.len());
    // Decode rows together: their states stacked, the token-by-token form once.
    let decoding: Vec<usize> = (0..segments.len())
        .filter(|&i| segments[i].rows.len() == 1)
        .collect();
    if !decoding.is_empty() {
        let rows: Vec<usize> = decoding.iter().map(|&i| segments[i].rows.start).collect();
        let mut convs = Vec::with_capacity(rows.len());
        let mut ssms = Vec::with_capacity(rows.len());
        for &i in &decoding {
            let st = segments[i].state.shaped(be, &sh)?;
            convs.push(st.conv);
            ssms.push(st.ssm);
        }
        let stacked = if rows.len() == 1 {
            DeltaStates {
                conv: convs.remove(0),
                ssm: ssms.remove(0),
            }
        } else {
            DeltaStates {
                conv: s
                    .concatenate(&convs.iter().collect::<Vec<_>>(), 0)
                    .map_err(mlx_err)?,
                ssm: s
                    .concatenate(&ssms.iter().collect::<Vec<_>>(), 0)
                    .map_err(mlx_err)?,
            }
        };
        let (out, next) = run(&rows, 1, &stacked, false)?;
        let n = rows.len() as i32;
        let out = s.reshape(&out, &[n, vd]).map_err(mlx_err)?;
        for (j, &i) in decoding.iter().enumerate() {
            let j = j as i32;
            let one = |a: &Array| -> Result<Array> {
                let mut stop = a.shape();
                let mut start = vec![0; stop.len()];
                start[0] = j;
                stop[0] = j + 1;
                s.slice(a, &start, &stop).map_err(mlx_err)
            };
            let seg = &mut segments[i];
            seg.state.host = None;
            seg.state.states = Some(DeltaStates {
                conv: one(&next.conv)?,
                ssm: one(&next.ssm)?,
            });
            let row = if n == 1 { out.clone() } else { one(&out)? };
            outs.push((seg.rows.start, row));
        }
    }
    for seg in segments.iter_mut().filter(|g| g.rows.len() > 1) {
        let m = seg.rows.len();
        let states = seg.state.shaped(be, &sh)?;
        let (out, next) = run(&[seg.rows.start], m, &states, m >= CHUNKED_ROWS)?;
        seg.state.host = None;
        seg.state.states = Some(next);
        outs.push((
            seg.rows.start,
            s.reshape(&out, &[m as i32, vd]).map_err(mlx_err)?,
        ));
    }
    outs.sort_by_key(|(r, _)| *r);
    if outs.len() == 1 {
        return Ok(outs.remove(0).1);
    }
    let parts: Vec<&Array> = outs.iter().map(|(_, a)| a).collect();
    s.concatenate(&parts, 0).map_err(mlx_err)
}
