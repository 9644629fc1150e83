//! Operations, as methods of the [`Stream`] they run on. Each builds a graph node and
//! returns at once; see [`crate::eval`].
use crate::array::{make, Array, Dtype};
use crate::error::{MlxError, Result};
use crate::ffi;
use crate::stream::Stream;

/// Activation of a gated MLP, for [`Stream::glu`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GluActivation {
    /// `x · sigmoid(x)`
    Silu,
    /// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`
    GeluTanh,
}

/// How [`Stream::sdpa`] masks scores.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Every query sees every key.
    None,
    /// Query `i` of `L` sees keys up to `S - L + i` (aligned to the end of the keys).
    Causal,
    /// A boolean (true = visible) or additive array broadcastable to `[B, H, L, S]`.
    Array(&'a Array),
}

/// The affine quantization of a matrix: `w ≈ scales · q + biases` per group of
/// `group_size` consecutive elements of a row, `q` packed `32 / bits` to a `u32` word
/// (first element in the lowest bits).
#[derive(Debug, Clone)]
pub struct Quantized {
    /// Packed `[rows, cols · bits / 32]` u32 words.
    pub weight: Array,
    /// `[rows, cols / group_size]`.
    pub scales: Array,
    /// `[rows, cols / group_size]`.
    pub biases: Array,
    /// Elements per group (32, 64 or 128).
    pub group_size: i32,
    /// Bits per element (2, 3, 4, 5, 6 or 8).
    pub bits: i32,
}

fn len_check(op: &'static str, a: &[i32], b: &[i32]) -> Result<()> {
    if a.len() != b.len() {
        return Err(MlxError::InvalidArgument {
            op,
            reason: format!("start {a:?} and stop {b:?} differ in length"),
        });
    }
    Ok(())
}

impl Stream {
    /// `a` with a new shape of the same size.
    pub fn reshape(&self, a: &Array, shape: &[i32]) -> Result<Array> {
        // SAFETY: live handle, shape slice valid for the call.
        make("reshape", |o| unsafe {
            ffi::wm_reshape(a.raw, shape.as_ptr(), shape.len() as i32, self.raw, o)
        })
    }

    /// `a` with its axes permuted.
    pub fn transpose(&self, a: &Array, axes: &[i32]) -> Result<Array> {
        // SAFETY: as above.
        make("transpose", |o| unsafe {
            ffi::wm_transpose(a.raw, axes.as_ptr(), axes.len() as i32, self.raw, o)
        })
    }

    /// `a[start..stop]` along every axis.
    pub fn slice(&self, a: &Array, start: &[i32], stop: &[i32]) -> Result<Array> {
        len_check("slice", start, stop)?;
        // SAFETY: as above.
        make("slice", |o| unsafe {
            ffi::wm_slice(
                a.raw,
                start.as_ptr(),
                stop.as_ptr(),
                start.len() as i32,
                self.raw,
                o,
            )
        })
    }

    /// `src` with `src[start..stop] = update` (in place when MLX may donate `src`).
    pub fn slice_update(
        &self,
        src: &Array,
        update: &Array,
        start: &[i32],
        stop: &[i32],
    ) -> Result<Array> {
        len_check("slice_update", start, stop)?;
        // SAFETY: as above.
        make("slice_update", |o| unsafe {
            ffi::wm_slice_update(
                src.raw,
                update.raw,
                start.as_ptr(),
                stop.as_ptr(),
                start.len() as i32,
                self.raw,
                o,
            )
        })
    }

    /// Arrays joined along `axis`.
    pub fn concatenate(&self, arrays: &[&Array], axis: i32) -> Result<Array> {
        let raw: Vec<ffi::wm_array> = arrays.iter().map(|a| a.raw).collect();
        // SAFETY: all handles live for the call.
        make("concatenate", |o| unsafe {
            ffi::wm_concatenate(raw.as_ptr(), raw.len(), axis, self.raw, o)
        })
    }

    /// Entries of `a` at `indices` along `axis`.
    pub fn take(&self, a: &Array, indices: &Array, axis: i32) -> Result<Array> {
        // SAFETY: live handles.
        make("take", |o| unsafe {
            ffi::wm_take(a.raw, indices.raw, axis, self.raw, o)
        })
    }

    /// `a` converted to `dtype`.
    pub fn astype(&self, a: &Array, dtype: Dtype) -> Result<Array> {
        // SAFETY: live handle.
        make("astype", |o| unsafe {
            ffi::wm_astype(a.raw, dtype.code(), self.raw, o)
        })
    }

    /// `a` laid out row-major.
    pub fn contiguous(&self, a: &Array) -> Result<Array> {
        // SAFETY: live handle.
        make("contiguous", |o| unsafe {
            ffi::wm_contiguous(a.raw, self.raw, o)
        })
    }

    /// Zeros.
    pub fn zeros(&self, shape: &[i32], dtype: Dtype) -> Result<Array> {
        // SAFETY: shape slice valid for the call.
        make("zeros", |o| unsafe {
            ffi::wm_zeros(
                shape.as_ptr(),
                shape.len() as i32,
                dtype.code(),
                self.raw,
                o,
            )
        })
    }

    /// `a + b` (broadcasting).
    pub fn add(&self, a: &Array, b: &Array) -> Result<Array> {
        // SAFETY: live handles.
        make("add", |o| unsafe { ffi::wm_add(a.raw, b.raw, self.raw, o) })
    }

    /// `a * b` (broadcasting).
    pub fn multiply(&self, a: &Array, b: &Array) -> Result<Array> {
        // SAFETY: live handles.
        make("multiply", |o| unsafe {
            ffi::wm_multiply(a.raw, b.raw, self.raw, o)
        })
    }

    /// `a * k` in `a`'s dtype.
    pub fn scale(&self, a: &Array, k: f32) -> Result<Array> {
        // SAFETY: live handle.
        make("scale", |o| unsafe { ffi::wm_scale(a.raw, k, self.raw, o) })
    }

    /// `cap * tanh(a / cap)`.
    pub fn softcap(&self, a: &Array, cap: f32) -> Result<Array> {
        // SAFETY: live handle.
        make("softcap", |o| unsafe {
            ffi::wm_softcap(a.raw, cap, self.raw, o)
        })
    }

    /// Matrix product over the last two axes.
    pub fn matmul(&self, a: &Array, b: &Array) -> Result<Array> {
        // SAFETY: live handles.
        make("matmul", |o| unsafe {
            ffi::wm_matmul(a.raw, b.raw, self.raw, o)
        })
    }

    /// Index of the largest entry along `axis` (u32).
    pub fn argmax(&self, a: &Array, axis: i32) -> Result<Array> {
        // SAFETY: live handle.
        make("argmax", |o| unsafe {
            ffi::wm_argmax(a.raw, axis, self.raw, o)
        })
    }

    /// Softmax along `axis`, computed in float32.
    pub fn softmax(&self, a: &Array, axis: i32) -> Result<Array> {
        // SAFETY: live handle.
        make("softmax", |o| unsafe {
            ffi::wm_softmax(a.raw, axis, self.raw, o)
        })
    }

    /// `cond ? a : b`.
    pub fn where_(&self, cond: &Array, a: &Array, b: &Array) -> Result<Array> {
        // SAFETY: live handles.
        make("where", |o| unsafe {
            ffi::wm_where(cond.raw, a.raw, b.raw, self.raw, o)
        })
    }

    /// `act(gate) * up`, fused into one kernel by `mx::compile`.
    pub fn glu(&self, gate: &Array, up: &Array, act: GluActivation) -> Result<Array> {
        let code = match act {
            GluActivation::Silu => 0,
            GluActivation::GeluTanh => 1,
        };
        // SAFETY: live handles.
        make("glu", |o| unsafe {
            ffi::wm_glu(gate.raw, up.raw, code, self.raw, o)
        })
    }

    /// `act(x)` elementwise (an ungated MLP's activation), fused into one kernel by
    /// `mx::compile`.
    pub fn activation(&self, x: &Array, act: GluActivation) -> Result<Array> {
        let code = match act {
            GluActivation::Silu => 0,
            GluActivation::GeluTanh => 1,
        };
        // SAFETY: live handle.
        make("activation", |o| unsafe {
            ffi::wm_activation(x.raw, code, self.raw, o)
        })
    }

    /// `x · sigmoid(gate)` elementwise, the sigmoid in f32, the result in `x`'s dtype.
    pub fn sigmoid_gate(&self, x: &Array, gate: &Array) -> Result<Array> {
        // SAFETY: live handles.
        make("sigmoid_gate", |o| unsafe {
            ffi::wm_sigmoid_gate(x.raw, gate.raw, self.raw, o)
        })
    }

    /// The gated DeltaNet mixer of `B` sequences of `m` rows each (see [`GatedDelta`]):
    /// the output `[B, m, v_heads · v_dim]` in the inputs' dtype and the new states.
    pub fn gated_delta(&self, d: &GatedDelta<'_>) -> Result<(Array, DeltaStates)> {
        let mut out: ffi::wm_array = std::ptr::null_mut();
        let mut conv: ffi::wm_array = std::ptr::null_mut();
        let mut ssm: ffi::wm_array = std::ptr::null_mut();
        let dims = [
            d.heads.0 as i32,
            d.heads.1 as i32,
            d.dims.0 as i32,
            d.dims.1 as i32,
        ];
        // SAFETY: live handles, a 4-element dims array and valid out pointers; on success
        // all three are set.
        let status = unsafe {
            ffi::wm_gated_delta(
                d.qkv.raw,
                d.z.raw,
                d.b.raw,
                d.a.raw,
                d.states.conv.raw,
                d.states.ssm.raw,
                d.conv_weight.raw,
                d.neg_a.raw,
                d.dt_bias.raw,
                d.norm.raw,
                dims.as_ptr(),
                d.eps,
                d.chunked as i32,
                self.raw,
                &mut out,
                &mut conv,
                &mut ssm,
            )
        };
        crate::array::check(status, "gated_delta")?;
        Ok((
            Array { raw: out },
            DeltaStates {
                conv: Array { raw: conv },
                ssm: Array { raw: ssm },
            },
        ))
    }

    /// `x · wᵀ` for `x` `[B ≤ 8, K]` and `w` `[N, K]` in bf16/f16 by wick's own CUDA
    /// kernel (16-byte loads, several in flight per thread). GPU streams only.
    pub fn gemv(&self, x: &Array, w: &Array) -> Result<Array> {
        // SAFETY: live handles.
        make("gemv", |o| unsafe {
            ffi::wm_gemv(x.raw, w.raw, self.raw, o)
        })
    }

    /// `(x + r, rms_norm(x + r) · w)` for `[R, H]` bf16/f16 rows in one pass, by wick's
    /// own CUDA kernel with MLX's rounding. GPU streams only.
    pub fn add_rms_norm(
        &self,
        x: &Array,
        r: &Array,
        w: &Array,
        eps: f32,
    ) -> Result<(Array, Array)> {
        let mut sum: ffi::wm_array = std::ptr::null_mut();
        let mut out: ffi::wm_array = std::ptr::null_mut();
        // SAFETY: live handles and valid out pointers; on success both are set.
        let status =
            unsafe { ffi::wm_add_rms_norm(x.raw, r.raw, w.raw, eps, self.raw, &mut sum, &mut out) };
        crate::array::check(status, "add_rms_norm")?;
        Ok((Array { raw: sum }, Array { raw: out }))
    }

    /// `x · wᵀ` for an affine-quantized `w`.
    pub fn quantized_matmul(&self, x: &Array, w: &Quantized) -> Result<Array> {
        // SAFETY: live handles.
        make("quantized_matmul", |o| unsafe {
            ffi::wm_quantized_matmul(
                x.raw,
                w.weight.raw,
                w.scales.raw,
                w.biases.raw,
                w.group_size,
                w.bits,
                self.raw,
                o,
            )
        })
    }

    /// Affine quantization of `w` along its last axis (scales in `w`'s dtype).
    pub fn quantize(&self, w: &Array, group_size: i32, bits: i32) -> Result<Quantized> {
        let mut q: ffi::wm_array = std::ptr::null_mut();
        let mut s: ffi::wm_array = std::ptr::null_mut();
        let mut b: ffi::wm_array = std::ptr::null_mut();
        // SAFETY: live handle and valid out pointers; on success all three are set.
        let status =
            unsafe { ffi::wm_quantize(w.raw, group_size, bits, self.raw, &mut q, &mut s, &mut b) };
        crate::array::check(status, "quantize")?;
        Ok(Quantized {
            weight: Array { raw: q },
            scales: Array { raw: s },
            biases: Array { raw: b },
            group_size,
            bits,
        })
    }

    /// The float matrix a quantized one stands for (in the scales' dtype).
    pub fn dequantize(&self, w: &Quantized) -> Result<Array> {
        // SAFETY: live handles.
        make("dequantize", |o| unsafe {
            ffi::wm_dequantize(
                w.weight.raw,
                w.scales.raw,
                w.biases.raw,
                w.group_size,
                w.bits,
                self.raw,
                o,
            )
        })
    }

    /// RMS normalization over the last axis, times `weight` (MLX's fused kernel).
    pub fn rms_norm(&self, x: &Array, weight: &Array, eps: f32) -> Result<Array> {
        // SAFETY: live handles.
        make("rms_norm", |o| unsafe {
            ffi::wm_rms_norm(x.raw, weight.raw, eps, self.raw, o)
        })
    }

    /// LayerNorm over the last axis: `(x - mean) / sqrt(var + eps)`, times `weight`, plus
    /// `bias` (MLX's fused kernel; either may be absent).
    pub fn layer_norm(
        &self,
        x: &Array,
        weight: Option<&Array>,
        bias: Option<&Array>,
        eps: f32,
    ) -> Result<Array> {
        let raw = |a: Option<&Array>| a.map_or(std::ptr::null_mut(), |a| a.raw);
        // SAFETY: live handles or null, which the shim reads as absent.
        make("layer_norm", |o| unsafe {
            ffi::wm_layer_norm(x.raw, raw(weight), raw(bias), eps, self.raw, o)
        })
    }

    /// Rotary embedding of the first `dims` features of `x` `[B, H, L, D]`; row `l` of
    /// batch `b` is at position `offset(b) + l`, angles `position · scale / freqs[i]`
    /// (periods `freqs`, or `base^(2i/dims)` when `freqs` is `None`).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &Array,
        dims: i32,
        traditional: bool,
        base: f32,
        scale: f32,
        offset: RopeOffset<'_>,
        freqs: Option<&Array>,
    ) -> Result<Array> {
        let (off, offs) = match offset {
            RopeOffset::Fixed(o) => (o, std::ptr::null_mut()),
            RopeOffset::PerBatch(a) => (0, a.raw),
        };
        let f = freqs.map_or(std::ptr::null_mut(), |a| a.raw);
        // SAFETY: live handles or null where the shim accepts null.
        make("rope", |o| unsafe {
            ffi::wm_rope(
                x.raw,
                dims,
                traditional as i32,
                base,
                scale,
                off,
                offs,
                f,
                self.raw,
                o,
            )
        })
    }

    /// Fused attention `softmax(q·kᵀ·scale + mask)·v` over `[B, H, L, D]` queries and
    /// `[B, H_kv, S, D]` keys/values (grouped-query when `H_kv < H`).
    pub fn sdpa(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
        mask: AttentionMask<'_>,
    ) -> Result<Array> {
        let (mode, m) = match mask {
            AttentionMask::None => (0, std::ptr::null_mut()),
            AttentionMask::Causal => (1, std::ptr::null_mut()),
            AttentionMask::Array(a) => (2, a.raw),
        };
        // SAFETY: live handles or null where the shim accepts null.
        make("sdpa", |o| unsafe {
            ffi::wm_sdpa(q.raw, k.raw, v.raw, scale, mode, m, self.raw, o)
        })
    }
}

/// The recurrent states of `B` sequences in one gated DeltaNet layer, float32.
#[derive(Debug, Clone)]
pub struct DeltaStates {
    /// The convolution's last `kernel - 1` inputs, `[B, kernel - 1, conv_dim]`.
    pub conv: Array,
    /// The delta rule's matrices, `[B, v_heads, k_dim, v_dim]`.
    pub ssm: Array,
}

/// The inputs of [`Stream::gated_delta`]: one gated DeltaNet layer (Qwen 3.5's linear
/// attention) over `B` sequences of `m` new rows each.
#[derive(Debug)]
pub struct GatedDelta<'a> {
    /// `[B, m, conv_dim]`: queries, keys and values before the convolution.
    pub qkv: &'a Array,
    /// `[B, m, v_heads · v_dim]`: the output gate.
    pub z: &'a Array,
    /// `[B, m, v_heads]`: write strengths before the sigmoid.
    pub b: &'a Array,
    /// `[B, m, v_heads]`: decay inputs before the softplus.
    pub a: &'a Array,
    /// The sequences' states before the rows.
    pub states: &'a DeltaStates,
    /// `[conv_dim, kernel]` float32.
    pub conv_weight: &'a Array,
    /// `-exp(A_log)` per value head, float32.
    pub neg_a: &'a Array,
    /// `dt_bias` per value head, float32.
    pub dt_bias: &'a Array,
    /// The gated norm's weight `[v_dim]`, float32.
    pub norm: &'a Array,
    /// Key heads and value heads.
    pub heads: (usize, usize),
    /// Key and value head dimensions.
    pub dims: (usize, usize),
    /// The gated norm's epsilon.
    pub eps: f32,
    /// The chunked form of the delta rule (64 tokens at a time: prompts), else token by
    /// token (decode rows).
    pub chunked: bool,
}

/// Where rotary positions start, for [`Stream::rope`].
#[derive(Debug, Clone, Copy)]
pub enum RopeOffset<'a> {
    /// One offset for the whole batch.
    Fixed(i32),
    /// One offset per batch entry (int32 `[B]`).
    PerBatch(&'a Array),
}
