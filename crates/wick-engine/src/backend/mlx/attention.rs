//! Attention on MLX: per sequence, append the new keys/values to its cache and run MLX's
//! fused scaled-dot-product attention over the cache (causal for several new rows, a
//! boolean mask for sliding windows and for rows that see keys past their own position);
//! explicit score math only for score soft-capping. Sequences decoding one token each go
//! together through a batch buffer (`arena.rs`). A layer may also attend to a cache an
//! earlier layer of the pass filled (Gemma 4's KV sharing, [`attend_cached`]).
use wick_mlx::{Array, AttentionMask, Dtype, Stream};

use super::arena;
use super::kv::MlxKvLayer;
use super::mlx_err;
use crate::backend::{AttentionParams, AttentionSegment};
use crate::Result;

/// `[m, H·D]` rows → `[1, H, m, D]`.
fn heads_first(s: &Stream, x: &Array, m: usize, heads: usize, hd: usize) -> Result<Array> {
    let x = s
        .reshape(x, &[1, m as i32, heads as i32, hd as i32])
        .map_err(mlx_err)?;
    s.transpose(&x, &[0, 2, 1, 3]).map_err(mlx_err)
}

/// Rows `r` of a `[n, cols]` tensor.
fn rows(s: &Stream, x: &Array, from: usize, to: usize) -> Result<Array> {
    let cols = x.shape().get(1).copied().unwrap_or(0);
    s.slice(x, &[from as i32, 0], &[to as i32, cols])
        .map_err(mlx_err)
}

/// Visibility of keys `key_start..key_end` to queries at `q_start..q_start + m`: query `i`
/// sees the keys before `ends[i]` (its own position + 1 without `ends`), back to its
/// sliding window.
fn mask(
    q_start: usize,
    m: usize,
    (key_start, key_end): (usize, usize),
    window: Option<usize>,
    ends: Option<&[usize]>,
) -> Result<Array> {
    let n = key_end - key_start;
    let mut v = Vec::with_capacity(m * n);
    for i in 0..m {
        let p = q_start + i;
        let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
        let end = ends.and_then(|e| e.get(i)).map_or(p + 1, |&e| e.max(p + 1));
        for j in key_start..key_end {
            v.push((j < end && j >= lo) as u8);
        }
    }
    Array::from_bytes(&v, &[m as i32, n as i32], Dtype::Bool).map_err(mlx_err)
}

/// Soft-capped attention with explicit scores (MLX's fused kernel has no soft-cap).
#[allow(clippy::too_many_arguments)]
fn softcapped(
    s: &Stream,
    q: &Array,
    k: &Array,
    v: &Array,
    m: usize,
    visible: &Array,
    p: &AttentionParams,
    cap: f32,
) -> Result<Array> {
    let (h, hk, hd) = (p.heads as i32, p.kv_heads as i32, p.head_dim as i32);
    let g = h / hk;
    let m = m as i32;
    let e = mlx_err;
    let keys = k.shape()[2];
    // Query heads of one KV head are adjacent: [1, H, m, D] → [1, Hk, g·m, D].
    let q = s.reshape(q, &[1, hk, g * m, hd]).map_err(e)?;
    let kt = s.transpose(k, &[0, 1, 3, 2]).map_err(e)?;
    let scores = s.matmul(&q, &kt).map_err(e)?;
    let scores = s.astype(&scores, Dtype::F32).map_err(e)?;
    let scores = s.scale(&scores, p.scale).map_err(e)?;
    let scores = s.softcap(&scores, cap).map_err(e)?;
    let scores = s.reshape(&scores, &[1, hk, g, m, keys]).map_err(e)?;
    let neg = Array::from_slice(&[f32::NEG_INFINITY], &[]).map_err(e)?;
    let scores = s.where_(visible, &scores, &neg).map_err(e)?;
    let probs = s.softmax(&scores, -1).map_err(e)?;
    let probs = s.astype(&probs, v.dtype()).map_err(e)?;
    let probs = s.reshape(&probs, &[1, hk, g * m, keys]).map_err(e)?;
    let out = s.matmul(&probs, v).map_err(e)?;
    s.reshape(&out, &[1, h, m, hd]).map_err(e)
}

/// Which segments of a step decode through a batch buffer (`arena.rs`): those of one new
/// token, when there are several or one is already in a buffer. None for layers the
/// buffer does not serve (sliding windows, soft-capped scores).
fn batched(segments: &[AttentionSegment<'_, MlxKvLayer>], p: &AttentionParams) -> Vec<bool> {
    let mut single: Vec<bool> = segments.iter().map(|g| g.rows.len() == 1).collect();
    let count = single.iter().filter(|&&b| b).count();
    let worth = count > 1
        || segments
            .iter()
            .zip(&single)
            .any(|(g, &b)| b && arena::in_arena(g.cache));
    if !worth || p.window.is_some() || p.softcap.is_some() {
        single.fill(false);
    }
    single
}

/// How a pass's rows see the keys beyond what causal attention shows them.
#[derive(Clone, Copy)]
pub(crate) struct Reach<'a> {
    /// Whether keys that fell out of a sliding window are dropped afterwards (the last
    /// layer reading a shared cache in the pass).
    pub evict: bool,
    /// Row `i` of the batch sees the keys before position `ends[i]`.
    pub ends: Option<&'a [usize]>,
}

impl Reach<'_> {
    /// Plain causal attention that owns its cache.
    pub(crate) const CAUSAL: Reach<'static> = Reach {
        evict: true,
        ends: None,
    };
}

/// See the module docs; `q` `[n, H·D]`, `k`/`v` `[n, Hk·D]`, returns `[n, H·D]`.
pub(crate) fn attend(
    s: &Stream,
    q: &Array,
    k: &Array,
    v: &Array,
    segments: &mut [AttentionSegment<'_, MlxKvLayer>],
    p: &AttentionParams,
    reach: Reach<'_>,
) -> Result<Array> {
    let mut in_batch = batched(segments, p);
    if reach.ends.is_some() {
        in_batch.fill(false);
    }
    let mut outs = Vec::with_capacity(segments.len());
    // Rows of the batch in the order of the rows of `outs`.
    let mut order: Vec<usize> = Vec::new();
    if in_batch.contains(&true) {
        let rows: Vec<usize> = segments
            .iter()
            .zip(&in_batch)
            .filter(|(_, &b)| b)
            .map(|(g, _)| g.rows.start)
            .collect();
        let mut layers: Vec<&mut MlxKvLayer> = segments
            .iter_mut()
            .zip(&in_batch)
            .filter(|(_, &b)| b)
            .map(|(g, _)| &mut *g.cache)
            .collect();
        let (qb, kb, vb) = (
            arena::gather(s, q, &rows)?,
            arena::gather(s, k, &rows)?,
            arena::gather(s, v, &rows)?,
        );
        outs.push(arena::decode_step(s, &mut layers, &qb, &kb, &vb, p)?);
        order.extend(rows);
    }
    let single = segments.len() == 1;
    for (seg, _) in segments.iter_mut().zip(&in_batch).filter(|(_, &b)| !b) {
        order.extend(seg.rows.clone());
        outs.push(one_sequence(s, q, k, v, seg, p, single, reach)?);
    }
    reorder(s, outs, &order)
}

/// The outputs of the segments (rows `order` of the batch, in that order) joined in batch
/// order.
fn reorder(s: &Stream, mut outs: Vec<Array>, order: &[usize]) -> Result<Array> {
    let joined = if outs.len() == 1 {
        outs.remove(0)
    } else {
        let refs: Vec<&Array> = outs.iter().collect();
        s.concatenate(&refs, 0).map_err(mlx_err)?
    };
    if order.iter().enumerate().all(|(i, &r)| i == r) {
        return Ok(joined);
    }
    // Back to batch order: row r of the result is row `at[r]` of `joined`.
    let mut at = vec![0; order.len()];
    for (i, &r) in order.iter().enumerate() {
        at[r] = i;
    }
    arena::gather(s, &joined, &at)
}

/// Attention of `q` `[n, H·D]` over each segment's cache as it stands: the cache already
/// holds this pass's rows as its last `rows.len()` tokens (an earlier layer of the pass
/// appended them). Returns `[n, H·D]`.
pub(crate) fn attend_cached(
    s: &Stream,
    q: &Array,
    segments: &mut [AttentionSegment<'_, MlxKvLayer>],
    p: &AttentionParams,
    reach: Reach<'_>,
) -> Result<Array> {
    let single = segments.len() == 1;
    let mut outs = Vec::with_capacity(segments.len());
    let mut order = Vec::new();
    for seg in segments.iter_mut() {
        let (a, b) = (seg.rows.start, seg.rows.end);
        let m = b - a;
        let cache = &mut *seg.cache;
        let q_start = cache
            .len
            .checked_sub(m)
            .filter(|&start| start >= cache.start)
            .ok_or_else(|| {
                crate::EngineError::Cache(
                    "mlx: a shared KV cache does not hold this pass's keys".into(),
                )
            })?;
        if cache.kv_heads != p.kv_heads || cache.head_dim != p.head_dim {
            return Err(crate::EngineError::Cache(format!(
                "mlx: a shared KV cache of {}x{} read as {}x{}",
                cache.kv_heads, cache.head_dim, p.kv_heads, p.head_dim
            )));
        }
        let qs = if single { q.clone() } else { rows(s, q, a, b)? };
        let q4 = heads_first(s, &qs, m, p.heads, p.head_dim)?;
        let ends = reach.ends.map(|e| &e[a..b]);
        outs.push(over_cache(s, &q4, cache, q_start, m, p, ends)?);
        if reach.evict {
            cache.evict()?;
        }
        order.extend(a..b);
    }
    reorder(s, outs, &order)
}

/// Attention of `m` queries `[1, H, m, D]` at positions `q_start..` over `cache`, which
/// holds their keys. Returns `[m, H·D]`.
fn over_cache(
    s: &Stream,
    q4: &Array,
    cache: &MlxKvLayer,
    q_start: usize,
    m: usize,
    p: &AttentionParams,
    ends: Option<&[usize]>,
) -> Result<Array> {
    let (h, hd) = (p.heads, p.head_dim);
    // Keys any of the queries may see.
    let key_start = match p.window {
        Some(w) => (q_start + 1).saturating_sub(w).max(cache.start),
        None => cache.start,
    };
    // Without `ends` no query sees past the last of them.
    let key_end = match ends {
        Some(_) => cache.len,
        None => q_start + m,
    };
    let (keys, values) = cache.range(key_start, key_end)?;
    let windowed = p.window.is_some_and(|w| m > 1 && key_end - key_start > w);
    let visible = || mask(q_start, m, (key_start, key_end), p.window, ends);
    let out = if let Some(cap) = p.softcap {
        softcapped(s, q4, &keys, &values, m, &visible()?, p, cap)?
    } else if ends.is_some() || windowed {
        s.sdpa(
            q4,
            &keys,
            &values,
            p.scale,
            AttentionMask::Array(&visible()?),
        )
        .map_err(mlx_err)?
    } else if m == 1 {
        s.sdpa(q4, &keys, &values, p.scale, AttentionMask::None)
            .map_err(mlx_err)?
    } else {
        s.sdpa(q4, &keys, &values, p.scale, AttentionMask::Causal)
            .map_err(mlx_err)?
    };
    let out = s.transpose(&out, &[0, 2, 1, 3]).map_err(mlx_err)?;
    s.reshape(&out, &[m as i32, (h * hd) as i32])
        .map_err(mlx_err)
}

/// Attention of one sequence's new rows over its own cache (`whole`: the batch is this
/// sequence alone, so `q`/`k`/`v` need no slicing). Returns `[m, H·D]`.
#[allow(clippy::too_many_arguments)]
fn one_sequence(
    s: &Stream,
    q: &Array,
    k: &Array,
    v: &Array,
    seg: &mut AttentionSegment<'_, MlxKvLayer>,
    p: &AttentionParams,
    whole: bool,
    reach: Reach<'_>,
) -> Result<Array> {
    let (h, hk, hd) = (p.heads, p.kv_heads, p.head_dim);
    let (a, b) = (seg.rows.start, seg.rows.end);
    let m = b - a;
    let (qs, ks, vs) = if whole {
        (q.clone(), k.clone(), v.clone())
    } else {
        (rows(s, q, a, b)?, rows(s, k, a, b)?, rows(s, v, a, b)?)
    };
    let cache = &mut *seg.cache;
    let q_start = cache.len;
    cache.append(
        &heads_first(s, &ks, m, hk, hd)?,
        &heads_first(s, &vs, m, hk, hd)?,
        m,
    )?;
    let q4 = heads_first(s, &qs, m, h, hd)?;
    let ends = reach.ends.map(|e| &e[a..b]);
    let out = over_cache(s, &q4, cache, q_start, m, p, ends)?;
    if reach.evict {
        cache.evict()?;
    }
    Ok(out)
}
