//! The narrow op surface model code is written against, and its implementations.
//!
//! Architectures in [`crate::models`] call only [`Backend`] methods, so the same decoder
//! runs on candle (CPU, portable, the default) and on other compute backends (MLX on
//! GPUs, cargo feature `mlx`; and [`tape`], the training backend that records the ops
//! of a pass for their gradients). A backend owns its tensor type, its weight-matrix type
//! (dense or quantized) and its KV-cache storage.
pub mod candle;
pub mod capability;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "mlx")]
pub mod mlx;
pub mod tape;

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use wick_gguf::GgmlType;

use crate::kv_pool::{BlockLease, BlockPool};
pub use crate::models::deltanet::{DeltaParams, DeltaShape, DeltaState};
pub use crate::models::moe::{Experts, MoeTensors};
use crate::weights::AffineWeight;
/// Weights as files hold them (moved to [`crate::weights`]; named here too for the
/// backends' implementations).
pub use crate::weights::HostWeight;
use crate::{EngineError, Result};

/// The compute backends a model can be loaded onto.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// The CPU (`--backend cpu`, also accepted as `candle`): wick's own kernels, the
    /// default.
    #[default]
    Candle,
    /// MLX (cargo feature `mlx`): its GPU backend where the runtime has one (CUDA,
    /// Metal), else its CPU backend.
    Mlx,
    /// wick's own CUDA backend (cargo feature `cuda`): NVIDIA GPUs.
    Cuda,
}

impl BackendKind {
    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Candle => "cpu",
            BackendKind::Mlx => "mlx",
            BackendKind::Cuda => "cuda",
        }
    }

    /// Whether this build can run the backend.
    pub fn available(self) -> bool {
        match self {
            BackendKind::Candle => true,
            BackendKind::Mlx => cfg!(feature = "mlx"),
            BackendKind::Cuda => cfg!(feature = "cuda"),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "candle" | "cpu" => Ok(BackendKind::Candle),
            "mlx" => Ok(BackendKind::Mlx),
            "cuda" => Ok(BackendKind::Cuda),
            other => Err(EngineError::InvalidInput(format!(
                "unknown backend '{other}' (expected cpu, mlx or cuda)"
            ))),
        }
    }
}

/// Activation function of the gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (Llama, Qwen).
    Silu,
    /// `gelu_tanh(gate) * up` (Gemma).
    GeluTanh,
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x0, x1), (x2, x3) …` — llama.cpp's "normal" rope, used by GGUF
    /// Llama files, whose Q/K rows the converter permuted.
    Interleaved,
    /// Halves `(x_i, x_{i+d/2})` — Hugging Face's `rotate_half`, llama.cpp's NEOX.
    Neox,
}

/// Everything needed to compute rotary angles for a position.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    /// Pairing of dimensions.
    pub style: RopeStyle,
    /// Rotated dimensions per head (usually the head dimension).
    pub dims: usize,
    /// Inverse frequency of each pair (`dims / 2` values), scaling already applied.
    pub inv_freq: Vec<f32>,
    /// Positions are multiplied by this before the angles (linear scaling: `1/factor`).
    pub position_scale: f32,
    /// Cosines and sines are multiplied by this (YaRN, LongRoPE; 1 otherwise).
    pub attention_factor: f32,
}

impl RopeSpec {
    /// Standard inverse frequencies `theta^(-2i/dims)`.
    pub fn base_inv_freq(theta: f64, dims: usize) -> Vec<f32> {
        (0..dims / 2)
            .map(|i| (1.0 / theta.powf(2.0 * i as f64 / dims as f64)) as f32)
            .collect()
    }
}

/// Shape and numerics of one attention layer.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionParams {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Multiplier of `q·k` before the softmax.
    pub scale: f32,
    /// Sliding window: a query at position `p` sees keys at `p - window + 1 ..= p`.
    pub window: Option<usize>,
    /// `cap * tanh(score / cap)` on the scores (Gemma 2).
    pub softcap: Option<f32>,
}

/// What [`Backend::norm_rope_qkv`] returns: the rotated queries, and the keys and values
/// where they were given.
#[derive(Debug, Clone)]
pub struct NormedHeads<T> {
    /// Normalized and rotated queries.
    pub q: T,
    /// Normalized and rotated keys.
    pub k: Option<T>,
    /// Normalized values.
    pub v: Option<T>,
}

/// [`Backend::norm_rope_qkv`] as separate norms and rotations (its default, and a fused
/// backend's way for shapes its kernel does not take).
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_rope_qkv_apart<B: Backend + ?Sized>(
    be: &B,
    q: (&B::Tensor, &B::Tensor),
    k: Option<(&B::Tensor, &B::Tensor)>,
    v: Option<(&B::Tensor, &B::Tensor)>,
    heads: usize,
    kv_heads: usize,
    table: &B::Rope,
    eps: f32,
) -> Result<NormedHeads<B::Tensor>> {
    let qn = be.rms_norm(q.0, q.1, eps)?;
    let (q, k) = match k {
        Some((k, w)) => {
            let kn = be.rms_norm(k, w, eps)?;
            let (q, k) = be.rope_qk(&qn, heads, &kn, kv_heads, table)?;
            (q, Some(k))
        }
        None => (be.rope(&qn, heads, table)?, None),
    };
    let v = v.map(|(v, w)| be.rms_norm(v, w, eps)).transpose()?;
    Ok(NormedHeads { q, k, v })
}

/// [`Backend::add_post_norm`] as separate ops: the post-norm, then the residual add with
/// the next input norm (one op where `scale` is 1), else add, scale and norm.
pub(crate) fn add_post_norm_apart<B: Backend + ?Sized>(
    be: &B,
    x: &B::Tensor,
    y: &B::Tensor,
    post: &B::Tensor,
    eps: f32,
    scale: f32,
    next: Option<&B::Tensor>,
) -> Result<(B::Tensor, Option<B::Tensor>)> {
    let y = be.rms_norm(y, post, eps)?;
    if let (Some(w), true) = (next, scale == 1.0) {
        let (sum, normed) = be.add_rms_norm(x, &y, w, eps)?;
        return Ok((sum, Some(normed)));
    }
    let mut sum = be.add(x, &y)?;
    if scale != 1.0 {
        sum = be.scale(&sum, scale)?;
    }
    let normed = next.map(|w| be.rms_norm(&sum, w, eps)).transpose()?;
    Ok((sum, normed))
}

/// One sequence's slice of a flattened batch, with that sequence's cache for the layer.
pub struct AttentionSegment<'a, L> {
    /// Rows of the flattened batch that belong to this sequence.
    pub rows: Range<usize>,
    /// The sequence's cache for this layer; new keys/values are appended to it.
    pub cache: &'a mut L,
}

/// Host copy of one layer's cache, for snapshots and the SSD tier.
#[derive(Debug, Clone, PartialEq)]
pub struct KvLayerSnapshot {
    /// Logical position of the first stored token (non-zero once a window dropped tokens).
    pub start: usize,
    /// Logical length (tokens seen).
    pub len: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Sliding window of the layer, if any.
    pub window: Option<usize>,
    /// Keys, `[len - start][kv_heads][head_dim]`.
    pub keys: Vec<f32>,
    /// Values, same layout.
    pub values: Vec<f32>,
}

impl KvLayerSnapshot {
    /// Tokens the snapshot stores (`len - start`), checked against its key and value
    /// floats: what every backend verifies before rebuilding a layer from it.
    pub fn stored(&self) -> Result<usize> {
        let row = self.kv_heads * self.head_dim;
        let stored = self.len.checked_sub(self.start).ok_or_else(|| {
            EngineError::Cache(format!("snapshot start {} > len {}", self.start, self.len))
        })?;
        let floats = stored.checked_mul(row);
        if floats != Some(self.keys.len()) || floats != Some(self.values.len()) {
            return Err(EngineError::Cache(format!(
                "snapshot holds {} key and {} value floats, expected {stored} tokens of {row}",
                self.keys.len(),
                self.values.len(),
            )));
        }
        Ok(stored)
    }
}

/// The trimmability rule every backend's KV layer follows: a layer of `len` tokens whose
/// first kept token is `start` (a sliding `window` dropped the ones before) can be cut to
/// `to` tokens only while every key the shorter sequence's next query sees is still there.
pub(crate) fn can_trim(len: usize, start: usize, window: Option<usize>, to: usize) -> bool {
    if to > len {
        return false;
    }
    match window {
        None => true,
        Some(w) => start <= (to + 1).saturating_sub(w),
    }
}

/// The error of a trim that [`can_trim`] refuses.
pub(crate) fn untrimmable(len: usize, start: usize, to: usize) -> EngineError {
    EngineError::Cache(format!(
        "cannot trim a sliding-window cache of {len} tokens (first kept {start}) to {to}"
    ))
}

/// [`KvLayer::trim`] of a cache whose storage keeps tokens `start..len` and lets later
/// appends overwrite what lies past its length (the MLX and CUDA layers).
#[cfg(any(feature = "mlx", feature = "cuda"))]
pub(crate) fn trim_span(
    len: &mut usize,
    start: &mut usize,
    window: Option<usize>,
    to: usize,
) -> crate::Result<()> {
    if !can_trim(*len, *start, window, to) {
        return Err(untrimmable(*len, *start, to));
    }
    if to < *start {
        *start = to;
    }
    *len = to;
    Ok(())
}

/// Per-layer, per-sequence key/value storage of a backend.
pub trait KvLayer: Clone + Send + Sync {
    /// Tokens seen (the next token's position).
    fn len(&self) -> usize;
    /// Whether no token is stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether [`KvLayer::trim`] to `len` can succeed: a sliding window that already
    /// dropped keys the shorter sequence would need cannot be trimmed.
    fn can_trim_to(&self, len: usize) -> bool;
    /// Forgets every token from position `len` on.
    fn trim(&mut self, len: usize) -> Result<()>;
    /// Bytes held.
    fn byte_size(&self) -> usize;
    /// Host copy.
    fn snapshot(&self) -> KvLayerSnapshot;

    /// Blocks of the KV pool's unit ([`crate::kv_pool::block_bytes`] of this layer) its
    /// storage holds now: what an attached layer is charged.
    fn held_blocks(&self) -> usize;
    /// Blocks its storage will hold once `tokens` more are appended (before any sliding
    /// window drops old ones).
    fn blocks_after(&self, tokens: usize) -> usize;
    /// Most blocks a layer with `window` ever holds for a sequence of `tokens` tokens fed
    /// at most `chunk` at a time.
    fn peak_blocks(tokens: usize, window: Option<usize>, chunk: usize) -> usize
    where
        Self: Sized;
    /// The layer's charge to a KV pool, when it is attached to one.
    fn lease(&self) -> Option<&BlockLease>;
    /// Sets or clears the charge ([`KvLayer::attach`], [`KvLayer::detach`]).
    fn lease_mut(&mut self) -> &mut Option<BlockLease>;

    /// Charges the blocks this layer holds to `pool` (past the budget if need be; the
    /// caller checks room first). A layer already attached is left as it is.
    fn attach(&mut self, pool: &Arc<BlockPool>) {
        if self.lease().is_none() {
            let held = self.held_blocks();
            pool.charge(held);
            *self.lease_mut() = Some(BlockLease::new(pool.clone(), held));
        }
    }
    /// Gives the pool charge back; the storage stays.
    fn detach(&mut self) {
        *self.lease_mut() = None;
    }
    /// Blocks charged to the pool (0 when detached).
    fn charged_blocks(&self) -> usize {
        self.lease().map_or(0, BlockLease::charged)
    }
    /// Blocks beyond the charge that appending `tokens` needs.
    fn extra_blocks_for(&self, tokens: usize) -> usize {
        self.blocks_after(tokens)
            .saturating_sub(self.charged_blocks())
    }
    /// Makes room for `tokens` more tokens at once where storage grows by reallocating
    /// and copying (CUDA), so that a long prompt fed in chunks is not copied into a larger
    /// buffer every few hundred tokens. Storage of fixed blocks needs nothing (the
    /// default).
    fn preallocate(&mut self, tokens: usize) -> Result<()> {
        let _ = tokens;
        Ok(())
    }
    /// Tokens the layer stores once a decode step appended one (after any sliding-window
    /// eviction): what a step that lays rows side by side must make room for.
    fn stored_after_step(&self) -> usize {
        self.len() + 1
    }
    /// Blocks its storage holds after a decode step in which the widest participant's
    /// layer stores `widest` tokens ([`KvLayer::stored_after_step`]). Paged storage holds
    /// only its own tokens, whatever the others hold; storage that keeps a batch's rows in
    /// one buffer holds the buffer's width.
    fn blocks_after_decode_step(&self, _widest: usize) -> usize {
        self.blocks_after(1)
    }
    /// Makes the charge match the storage held (past the budget if the storage grew
    /// further than reserved: the next reservation then finds the pool full).
    fn settle(&mut self) {
        let held = self.held_blocks();
        if let Some(lease) = self.lease_mut() {
            lease.settle(held);
        }
    }
}

/// One sequence's recurrent state in one gated DeltaNet layer (Qwen 3.5's linear-attention
/// layers), as a backend keeps it: host memory on the CPU ([`DeltaState`] itself), device
/// memory on CUDA. Clones share or copy it; a clone that is written does not change the
/// original (the prompt cache keeps clones).
pub trait DeltaStore: Clone + Send + Sync {
    /// Bytes held.
    fn byte_size(&self) -> usize;
    /// Host copy, for snapshots (the prompt cache's tiers). A state that cannot be read
    /// back logs why and gives empty vectors, which a restore refuses.
    fn to_host(&self) -> DeltaState;
    /// The state in host memory, where the backend keeps it there: what the host form of
    /// [`Backend::delta_net`] updates.
    fn host_mut(&mut self) -> Option<&mut DeltaState> {
        None
    }
}

impl DeltaStore for DeltaState {
    fn byte_size(&self) -> usize {
        (self.conv.len() + self.ssm.len()) * 4
    }

    fn to_host(&self) -> DeltaState {
        self.clone()
    }

    fn host_mut(&mut self) -> Option<&mut DeltaState> {
        Some(self)
    }
}

/// One sequence's rows of a flattened batch and its state in one DeltaNet layer.
pub struct DeltaSegment<'a, S> {
    /// Rows of the batch that belong to this sequence.
    pub rows: Range<usize>,
    /// The sequence's state for the layer; the rows' tokens are absorbed into it.
    pub state: &'a mut S,
}

/// The inputs of a DeltaNet layer's mixer, `n` rows each: the projections of the layer's
/// normed input.
pub struct DeltaInputs<'a, T> {
    /// `[n, conv_dim]`: queries, keys and values before the convolution.
    pub qkv: &'a T,
    /// `[n, v_heads * v_dim]`: the output gate.
    pub z: &'a T,
    /// `[n, v_heads]`: write strengths before the sigmoid.
    pub b: &'a T,
    /// `[n, v_heads]`: decay inputs before the softplus.
    pub a: &'a T,
}

/// A DeltaNet layer's vectors uploaded for a backend that runs the mixer itself
/// ([`Backend::delta_weights`]), in whatever layout that backend reads.
pub struct DeltaTensors<T> {
    /// The convolution weight.
    pub conv: T,
    /// `-exp(A_log)` per value head.
    pub neg_a: T,
    /// `dt_bias` per value head.
    pub dt_bias: T,
    /// The gated norm's weight.
    pub norm: T,
}

/// One adapter's low-rank delta over some rows of a batch (see [`Backend::low_rank_add`]).
pub struct LowRankDelta<'a, B: Backend> {
    /// `[rank, in]`.
    pub a: &'a B::Matrix,
    /// `scale · B`, `[out, rank]`.
    pub b: &'a B::Matrix,
    /// The rows that use it, ascending.
    pub rows: &'a [usize],
    /// Whether `rows` is every row of the batch, in order.
    pub all: bool,
}

/// The op surface. Tensors are 2-D row-major `[rows, cols]` activations unless a method
/// says otherwise; a batch of several sequences is flattened into rows.
pub trait Backend: Send + Sync + 'static {
    /// Activation tensor.
    type Tensor: Clone + Send + Sync;
    /// Weight matrix `[out, in]`, dense or quantized.
    type Matrix: Send + Sync;
    /// Rotary angles for the positions of one forward pass.
    type Rope: Send + Sync;
    /// KV storage of one layer of one sequence.
    type KvLayer: KvLayer;
    /// Token ids computed on the backend (a device-side argmax), so the next step can
    /// be queued before the host reads them.
    type Ids: Send + Sync;
    /// One sequence's recurrent state in one gated DeltaNet layer.
    type DeltaState: DeltaStore;

    /// Short name for logs and errors.
    fn name(&self) -> &'static str;

    /// Runs `f`, one forward pass of the model, as a unit: a backend that records work
    /// runs it when `f` returns (or earlier, where a result is read to the host), and may
    /// replay a pass it ran before (the CUDA backend's graphs). The default runs `f`.
    fn pass<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R>
    where
        Self: Sized,
    {
        f()
    }

    /// Uploads a weight matrix; quantized types stay quantized where the backend can.
    fn matrix(&self, w: HostWeight<'_>) -> Result<Self::Matrix>;
    /// Uploads a matrix stored in MLX's affine quantized layout. Backends that cannot
    /// multiply it as is (the default) dequantize it on the host and upload that.
    fn affine_matrix(&self, w: AffineWeight<'_>) -> Result<Self::Matrix> {
        let values = w.dequantize()?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.matrix(HostWeight {
            name: w.name,
            dtype: GgmlType::F32,
            shape: vec![w.rows, w.cols],
            bytes: Cow::Owned(bytes),
        })
    }
    /// Uploads a 1-D weight (norm scale, bias) in the backend's activation type.
    fn vector(&self, w: HostWeight<'_>) -> Result<Self::Tensor>;
    /// `[out, in]` of a matrix.
    fn matrix_shape(&self, m: &Self::Matrix) -> (usize, usize);
    /// Bytes a matrix occupies.
    fn matrix_bytes(&self, m: &Self::Matrix) -> usize;

    /// Rows `ids` of an embedding table `[vocab, hidden]`.
    fn embed(&self, table: &Self::Matrix, ids: &[u32]) -> Result<Self::Tensor>;
    /// `x · wᵀ (+ bias)`: `[n, in] → [n, out]`.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Matrix,
        bias: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;
    /// [`Backend::linear`] of one input with several matrices (q/k/v, gate/up): a backend
    /// may quantize the input once and run the products as one parallel section.
    fn linear_many(
        &self,
        x: &Self::Tensor,
        ws: &[(&Self::Matrix, Option<&Self::Tensor>)],
    ) -> Result<Vec<Self::Tensor>> {
        ws.iter().map(|&(w, b)| self.linear(x, w, b)).collect()
    }
    /// Elementwise sum.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    /// Multiplies by a scalar.
    fn scale(&self, x: &Self::Tensor, s: f32) -> Result<Self::Tensor>;
    /// RMS normalization of every `weight.len()`-long group of `x`, times `weight`.
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;
    /// `(x + y, rms_norm(x + y) · weight)`: the residual add and the next norm, which a
    /// backend may do in one pass (one kernel launch instead of two on a GPU).
    fn add_rms_norm(
        &self,
        x: &Self::Tensor,
        y: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        let sum = self.add(x, y)?;
        let normed = self.rms_norm(&sum, weight, eps)?;
        Ok((sum, normed))
    }
    /// `s = (x + rms_norm(y) · post) · scale`, and with `next` also `rms_norm(s) · next`:
    /// a sandwich-normed block's output joining the residual stream (Gemma 2–4's post-norms)
    /// and the next block's input norm, which a backend may do in one launch.
    fn add_post_norm(
        &self,
        x: &Self::Tensor,
        y: &Self::Tensor,
        post: &Self::Tensor,
        eps: f32,
        scale: f32,
        next: Option<&Self::Tensor>,
    ) -> Result<(Self::Tensor, Option<Self::Tensor>)> {
        add_post_norm_apart(self, x, y, post, eps, scale, next)
    }
    /// Whether `parts` (matrices that multiply the same input) should be joined into one
    /// matrix of stacked rows by [`Backend::fuse_matrices`]: one bigger product instead of
    /// several small ones. Backends where that does not pay say no (the default).
    fn can_fuse(&self, parts: &[&Self::Matrix]) -> bool {
        let _ = parts;
        false
    }
    /// Stacks the rows of `parts` (for which [`Backend::can_fuse`] said yes).
    fn fuse_matrices(&self, parts: Vec<Self::Matrix>) -> Result<Self::Matrix> {
        let _ = parts;
        Err(EngineError::Backend {
            backend: self.name(),
            message: "this backend does not fuse matrices".into(),
        })
    }
    /// Consecutive column blocks of `x`, `widths` wide (the outputs of a fused product).
    fn split_columns(&self, x: &Self::Tensor, widths: &[usize]) -> Result<Vec<Self::Tensor>>;
    /// `act(gate) * up`.
    fn glu(&self, gate: &Self::Tensor, up: &Self::Tensor, act: Activation) -> Result<Self::Tensor>;
    /// `act(x · gateᵀ) * (x · upᵀ)` for a fused `[gate; up]` matrix ([`Backend::fuse_matrices`])
    /// of two `width`-row halves. By default the product, split and [`Backend::glu`]; a
    /// backend may pair each gate row with its up row in one kernel.
    fn linear_glu(
        &self,
        x: &Self::Tensor,
        gate_up: &Self::Matrix,
        width: usize,
        act: Activation,
    ) -> Result<Self::Tensor> {
        let both = self.linear(x, gate_up, None)?;
        match self.split_columns(&both, &[width, width])?.as_slice() {
            [gate, up] => self.glu(gate, up, act),
            _ => Err(EngineError::Backend {
                backend: self.name(),
                message: "split_columns returned too few parts".into(),
            }),
        }
    }
    /// `act(x · wᵀ) * mul`: a product whose outputs gate another tensor of their shape
    /// (Gemma 4's per-layer inputs). By default the product and [`Backend::glu`]; a backend
    /// may apply the activation and the factor as the product stores.
    fn linear_act_mul(
        &self,
        x: &Self::Tensor,
        w: &Self::Matrix,
        mul: &Self::Tensor,
        act: Activation,
    ) -> Result<Self::Tensor> {
        let gate = self.linear(x, w, None)?;
        self.glu(&gate, mul, act)
    }
    /// What the backend implements beyond the core ops ([`capability`]): the one
    /// declaration a model's needs are held against at load.
    fn capabilities(&self) -> &'static capability::Capabilities;
    /// LayerNorm of every `weight.len()`-long group of `x`: `(x - mean) / sqrt(var + eps)`
    /// times `weight`, plus `bias` (StarCoder 2). Backends without it say so.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        eps: f32,
    ) -> Result<Self::Tensor> {
        let _ = (x, weight, bias, eps);
        Err(EngineError::Backend {
            backend: self.name(),
            message: "LayerNorm is not implemented on this backend".into(),
        })
    }
    /// `act(x)` elementwise (an ungated MLP). Backends without it say so.
    fn activation(&self, x: &Self::Tensor, act: Activation) -> Result<Self::Tensor> {
        let _ = (x, act);
        Err(EngineError::Backend {
            backend: self.name(),
            message: "an ungated MLP activation is not implemented on this backend".into(),
        })
    }
    /// `cap * tanh(x / cap)`.
    fn softcap(&self, x: &Self::Tensor, cap: f32) -> Result<Self::Tensor>;
    /// Rows `rows` of `x`, in that order.
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
    /// Copies `x` `[n, cols]` to the host as f32 in consecutive groups of `groups[i]`
    /// rows, one row-major vector per group (empty for 0 rows): each sequence's logits
    /// with one copy and no copy of the whole.
    fn rows_to_host(&self, x: &Self::Tensor, groups: &[usize]) -> Result<Vec<Vec<f32>>>;

    /// Row-wise argmax of logits `[n, vocab]` (the first maximum), kept on the backend.
    fn argmax(&self, logits: &Self::Tensor) -> Result<Self::Ids>;
    /// [`Backend::argmax`] of each row of `logits` `[n, vocab]` with `masks[i]` applied to
    /// row `i` first: token `t` is allowed when bit `t % 32` of word `t / 32` is set (ids
    /// past the words are not), the rest count as `-inf`; a `None` mask allows every id.
    /// What structured output's greedy rows need, without the logits leaving the device.
    fn masked_argmax(&self, logits: &Self::Tensor, masks: &[Option<Vec<u32>>])
        -> Result<Self::Ids>;
    /// Starts computing `x` and all it depends on, without waiting (see
    /// [`Backend::schedule`]).
    fn schedule_tensor(&self, x: &Self::Tensor) -> Result<()> {
        let _ = x;
        Ok(())
    }
    /// Embedding rows for ids the backend holds (as [`Backend::embed`]).
    fn embed_ids(&self, table: &Self::Matrix, ids: &Self::Ids) -> Result<Self::Tensor>;
    /// The ids on the host; waits for them.
    fn ids_to_host(&self, ids: &Self::Ids) -> Result<Vec<u32>>;
    /// Starts computing `ids` and all they depend on, without waiting. Eager backends
    /// have already computed them.
    fn schedule(&self, ids: &Self::Ids) -> Result<()> {
        let _ = ids;
        Ok(())
    }

    /// Rotary angles for `positions` (one per row of the batch).
    fn rope_table(&self, positions: &[usize], spec: &RopeSpec) -> Result<Self::Rope>;
    /// Rotary angles where each row has several position components and frequency `i`
    /// turns with component `axes[i]` of the row (multimodal rotary: Qwen-VL's M-RoPE,
    /// whose image tokens have temporal, row and column positions, and the 2-D rotary of
    /// its vision tower). `axes` has one entry per frequency of `spec`. Backends without it
    /// (the default) say so.
    fn rope_table_axes(
        &self,
        positions: &[[usize; 3]],
        axes: &[u8],
        spec: &RopeSpec,
    ) -> Result<Self::Rope> {
        let _ = (positions, axes, spec);
        Err(EngineError::Backend {
            backend: self.name(),
            message: "multimodal rotary positions (M-RoPE, needed for image input) are not implemented on this backend; use --backend cpu".into(),
        })
    }
    /// Applies rotary embeddings to `x` `[n, heads * head_dim]`.
    fn rope(&self, x: &Self::Tensor, heads: usize, table: &Self::Rope) -> Result<Self::Tensor>;
    /// [`Backend::rope`] of a layer's queries (`heads` heads) and keys (`kv_heads`) with
    /// one table: a backend may do both in one launch.
    fn rope_qk(
        &self,
        q: &Self::Tensor,
        heads: usize,
        k: &Self::Tensor,
        kv_heads: usize,
        table: &Self::Rope,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        Ok((self.rope(q, heads, table)?, self.rope(k, kv_heads, table)?))
    }
    /// Per-head RMS norms (each weight one head long) of a layer's queries and keys, each
    /// followed by rotary embeddings, and of its values where `v` is given (Gemma 4
    /// normalizes them too, unrotated): [`Backend::rms_norm`] then [`Backend::rope_qk`], which
    /// a backend may do in one launch. Without `k` (a layer reading an earlier layer's keys)
    /// the queries alone are rotated.
    #[allow(clippy::too_many_arguments)]
    fn norm_rope_qkv(
        &self,
        q: (&Self::Tensor, &Self::Tensor),
        k: Option<(&Self::Tensor, &Self::Tensor)>,
        v: Option<(&Self::Tensor, &Self::Tensor)>,
        heads: usize,
        kv_heads: usize,
        table: &Self::Rope,
        eps: f32,
    ) -> Result<NormedHeads<Self::Tensor>> {
        norm_rope_qkv_apart(self, q, k, v, heads, kv_heads, table, eps)
    }

    /// A fused q/k/v product's output split into `widths` (queries, keys, values) with
    /// rotary embeddings on the queries and keys: [`split_columns`](Self::split_columns)
    /// then [`rope_qk`](Self::rope_qk) unless the backend does it in one pass.
    fn split_rope_qkv(
        &self,
        qkv: &Self::Tensor,
        widths: &[usize],
        heads: usize,
        kv_heads: usize,
        table: &Self::Rope,
    ) -> Result<(Self::Tensor, Self::Tensor, Self::Tensor)> {
        split_then_rope_qk(self, qkv, widths, heads, kv_heads, table)
    }

    /// An empty cache for one layer.
    fn new_kv_layer(
        &self,
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
    ) -> Self::KvLayer;
    /// Rebuilds a cache from a host copy.
    fn kv_layer_from_snapshot(&self, s: &KvLayerSnapshot) -> Result<Self::KvLayer>;
    /// Uploads a host activation `[rows, cols]` (row-major f32): the way back for model code
    /// that computes a step on the host (Qwen 3.5's DeltaNet mixer, Gemma 4). Backends that cannot
    /// (the default) say so.
    fn tensor_from_host(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<Self::Tensor> {
        let _ = (data, rows, cols);
        Err(EngineError::Backend {
            backend: self.name(),
            message: "this backend cannot upload host activations (needed by Qwen 3.5's linear-attention layers and Gemma 4's per-layer inputs)".into(),
        })
    }
    /// A zero recurrent state for one DeltaNet layer of `shape`.
    fn new_delta_state(&self, shape: &DeltaShape) -> Self::DeltaState;
    /// A recurrent state holding `s` (a host copy, checked against the layer's shape by
    /// the caller).
    fn delta_state_from_host(&self, s: DeltaState) -> Result<Self::DeltaState>;
    /// Uploads the vectors of a DeltaNet layer for [`Backend::delta_net`], once at load.
    /// Backends that mix on the host keep none (the default).
    fn delta_weights(&self, p: &DeltaParams<'_>) -> Result<Option<DeltaTensors<Self::Tensor>>> {
        let _ = p;
        Ok(None)
    }
    /// The token mixer of one gated DeltaNet layer over a flattened batch: the causal
    /// convolution of `x.qkv` (continuing each segment's convolution state), the
    /// normalized queries and keys, the gated delta rule (each segment's rows absorbed
    /// into its state, in order) and the gated RMS norm of its output. Returns
    /// `[n, v_heads * v_dim]`, what the layer's output projection multiplies. `uploaded`
    /// is what [`Backend::delta_weights`] gave for the layer. By default on the host
    /// ([`crate::models::deltanet::mix`] per segment, rows copied out and back), which
    /// needs host states ([`DeltaStore::host_mut`]) and host activations
    /// ([`Backend::tensor_from_host`]).
    fn delta_net(
        &self,
        p: &DeltaParams<'_>,
        uploaded: Option<&DeltaTensors<Self::Tensor>>,
        x: DeltaInputs<'_, Self::Tensor>,
        segments: &mut [DeltaSegment<'_, Self::DeltaState>],
    ) -> Result<Self::Tensor>
    where
        Self: Sized,
    {
        let _ = uploaded;
        crate::models::deltanet::mix_on_host(self, p, x, segments)
    }
    /// Uploads a mixture-of-experts layer's experts for [`Backend::moe`], once at load:
    /// `gate_up` `[experts, 2 * intermediate, hidden]` and `down` `[experts, hidden,
    /// intermediate]` (float types), and each expert's output scale. Backends that run the
    /// experts one by one from the host's routing (the default) keep none, and the layer
    /// uploads one matrix per expert.
    fn moe_weights(
        &self,
        gate_up: &HostWeight<'_>,
        down: &HostWeight<'_>,
        per_expert_scale: &[f32],
    ) -> Result<Option<MoeTensors<Self>>>
    where
        Self: Sized,
    {
        let _ = (gate_up, down, per_expert_scale);
        Ok(None)
    }
    /// The experts of a mixture-of-experts layer on `x` `[rows, hidden]`, routed by the
    /// router's `logits` `[rows, experts]` as [`crate::models::moe::Routing::softmax_top_k`]
    /// does (softmax, the `top_k` most probable, renormalised, times each expert's scale):
    /// each row's weighted sum of its experts' gated MLPs, `[rows, hidden]`. By default on
    /// the host ([`Experts::forward_on_host`]: the logits read back, the experts run one
    /// after another on the rows routed to them), which needs host activations
    /// ([`Backend::tensor_from_host`]).
    fn moe(
        &self,
        experts: &Experts<Self>,
        x: &Self::Tensor,
        logits: &Self::Tensor,
        rows: usize,
    ) -> Result<Self::Tensor>
    where
        Self: Sized,
    {
        experts.forward_on_host(self, x, logits, rows)
    }
    /// [`Backend::moe`] with `lora`'s deltas beside `layer`'s experts' products (PEFT's
    /// `target_parameters` on the stacked expert weights), each row with its own adapters.
    /// The default routes on the host ([`Experts::forward_on_host_with_deltas`]); the
    /// training backend records it, so the deltas' factors get gradients.
    fn moe_with_deltas(
        &self,
        experts: &Experts<Self>,
        x: &Self::Tensor,
        logits: &Self::Tensor,
        rows: usize,
        lora: &crate::adapters::LoraBatch<'_, Self>,
        layer: usize,
    ) -> Result<Self::Tensor>
    where
        Self: Sized,
    {
        experts.forward_on_host_with_deltas(self, x, logits, rows, lora, layer)
    }
    /// `x · sigmoid(gate)` elementwise for `x` and `gate` of `shape` (rows, columns): an
    /// attention layer's output gate (Qwen 3.5). By default on the host, which needs
    /// [`Backend::tensor_from_host`].
    fn sigmoid_gate(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
        shape: (usize, usize),
    ) -> Result<Self::Tensor> {
        let (rows, cols) = shape;
        let mut out = self.rows_to_host(x, &[rows])?.concat();
        let g = self.rows_to_host(gate, &[rows])?.concat();
        if out.len() != rows * cols || g.len() != out.len() {
            return Err(EngineError::Backend {
                backend: self.name(),
                message: format!(
                    "sigmoid_gate: {} and {} values for {rows}x{cols}",
                    out.len(),
                    g.len()
                ),
            });
        }
        for (x, g) in out.iter_mut().zip(&g) {
            *x /= 1.0 + (-g).exp();
        }
        self.tensor_from_host(out, rows, cols)
    }
    /// Causal attention of `q` `[n, heads*hd]` over each segment's cache after appending
    /// that segment's `k`/`v` rows `[n, kv_heads*hd]`. Returns `[n, heads*hd]`.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        segments: &mut [AttentionSegment<'_, Self::KvLayer>],
        params: &AttentionParams,
    ) -> Result<Self::Tensor>;

    /// [`Backend::attention`] where row `i` of the flattened batch sees the keys before
    /// position `ends[i]` (exclusive) instead of those up to its own position: an image's
    /// soft tokens see each other both ways. `ends[i]` lies between the row's position + 1
    /// and the end of its segment's new rows; a sliding window still counts back from the
    /// row's own position. Backends without it (the default) say so.
    fn attention_to(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        segments: &mut [AttentionSegment<'_, Self::KvLayer>],
        params: &AttentionParams,
        ends: &[usize],
    ) -> Result<Self::Tensor> {
        let _ = (q, k, v, segments, params, ends);
        Err(EngineError::Backend {
            backend: self.name(),
            message: "bidirectional attention inside an image (needed for image input) is not implemented on this backend; use --backend cpu".into(),
        })
    }

    /// [`Backend::attention`] for caches that several layers share (Gemma 4's KV sharing).
    /// With `new_kv` it appends those rows as `attention` does; without, each segment's
    /// cache already holds this pass's rows as its last `rows.len()` tokens (the owning
    /// layer appended them) and the queries attend to it as it stands. Keys that fall out
    /// of a sliding window are dropped only when `evict` is set: the last layer of the
    /// pass that reads the cache sets it. With `ends`, row `i` sees the keys before position
    /// `ends[i]`, as in [`Backend::attention_to`] (Gemma 4's bidirectional image blocks).
    /// Backends without KV sharing (the default) say so.
    fn attention_shared(
        &self,
        q: &Self::Tensor,
        new_kv: Option<(&Self::Tensor, &Self::Tensor)>,
        segments: &mut [AttentionSegment<'_, Self::KvLayer>],
        params: &AttentionParams,
        evict: bool,
        ends: Option<&[usize]>,
    ) -> Result<Self::Tensor> {
        match (new_kv, ends) {
            (Some((k, v)), None) if evict => self.attention(q, k, v, segments, params),
            (Some((k, v)), Some(ends)) if evict => {
                self.attention_to(q, k, v, segments, params, ends)
            }
            _ => Err(EngineError::Backend {
                backend: self.name(),
                message: "this backend does not implement KV caches shared between layers".into(),
            }),
        }
    }

    /// Each `ys[i]` plus the low-rank deltas of `deltas[i]`, in order, all computed from
    /// `x`: `y[r] = y[r] + (x[r] · Aᵀ) · Bᵀ` at the rows `r` of each delta (the adapters of
    /// several projections sharing one input). The default runs two [`Backend::linear`]
    /// products per delta and adds the result at its rows.
    fn low_rank_add(
        &self,
        x: &Self::Tensor,
        ys: Vec<Self::Tensor>,
        deltas: &[&[LowRankDelta<'_, Self>]],
    ) -> Result<Vec<Self::Tensor>>
    where
        Self: Sized,
    {
        low_rank_add_by_products(self, x, ys, deltas)
    }

    /// `y` with row `i` of `d` added to row `rows[i]` of it (an adapter's delta over the
    /// rows that use it). Backends without it refuse adapters on batches that mix them.
    fn add_rows(&self, y: &Self::Tensor, rows: &[usize], d: &Self::Tensor) -> Result<Self::Tensor> {
        let _ = (y, rows, d);
        Err(EngineError::Backend {
            backend: self.name(),
            message: "this backend cannot add a delta to some rows of a batch".into(),
        })
    }
}

/// [`Backend::split_rope_qkv`] as [`Backend::split_columns`] then [`Backend::rope_qk`] (the
/// default, and any backend's way for shapes its own kernel does not take).
pub fn split_then_rope_qk<B: Backend + ?Sized>(
    be: &B,
    qkv: &B::Tensor,
    widths: &[usize],
    heads: usize,
    kv_heads: usize,
    table: &B::Rope,
) -> Result<(B::Tensor, B::Tensor, B::Tensor)> {
    let mut parts = be.split_columns(qkv, widths)?.into_iter();
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(q), Some(k), Some(v), None) => {
            let (q, k) = be.rope_qk(&q, heads, &k, kv_heads, table)?;
            Ok((q, k, v))
        }
        _ => Err(EngineError::InvalidInput(format!(
            "split_rope_qkv: {} widths, expected 3",
            widths.len()
        ))),
    }
}

/// [`Backend::low_rank_add`] by two [`Backend::linear`] products per delta and an add at
/// its rows (the default, and any backend's way for operands its own path does not take).
pub fn low_rank_add_by_products<B: Backend>(
    be: &B,
    x: &B::Tensor,
    ys: Vec<B::Tensor>,
    deltas: &[&[LowRankDelta<'_, B>]],
) -> Result<Vec<B::Tensor>> {
    ys.into_iter()
        .zip(deltas)
        .map(|(mut y, ds)| {
            for d in ds.iter() {
                if d.all {
                    let t = be.linear(x, d.a, None)?;
                    let delta = be.linear(&t, d.b, None)?;
                    y = be.add(&y, &delta)?;
                } else {
                    let xs = be.select_rows(x, d.rows)?;
                    let t = be.linear(&xs, d.a, None)?;
                    let delta = be.linear(&t, d.b, None)?;
                    y = be.add_rows(&y, d.rows, &delta)?;
                }
            }
            Ok(y)
        })
        .collect()
}

/// Sets every logit `mask` does not allow to `-inf` (see [`Backend::masked_argmax`]).
pub(crate) fn apply_token_mask(mask: &[u32], logits: &mut [f32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = mask.get(w).copied().unwrap_or(0);
        if bits == u32::MAX && chunk.len() == 32 {
            continue;
        }
        for (b, logit) in chunk.iter_mut().enumerate() {
            if bits & (1 << b) == 0 {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
}
