//! Attention on MLX: per sequence, append the new keys/values to its cache and run MLX's
//! fused scaled-dot-product attention over the cache (causal for several new rows, a
//! boolean mask for sliding windows); explicit score math only for score soft-capping.
use wick_mlx::{Array, AttentionMask, Dtype, Stream};

use super::kv::{self, MlxKvLayer};
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

/// Visibility of keys `key_start..key_end` to queries at `q_start..q_start + m`.
fn mask(
    q_start: usize,
    m: usize,
    key_start: usize,
    key_end: usize,
    window: Option<usize>,
) -> Result<Array> {
    let n = key_end - key_start;
    let mut v = Vec::with_capacity(m * n);
    for i in 0..m {
        let p = q_start + i;
        let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
        for j in key_start..key_end {
            v.push((j <= p && j >= lo) as u8);
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

/// One decode step of `n` sequences sharing a left-padded buffer (row `i` = segment `i`
/// = batch row `i`): one write and one attention call for all; `None` when the batch is
/// not such a step.
fn lockstep_decode(
    s: &Stream,
    q: &Array,
    k: &Array,
    v: &Array,
    segments: &mut [AttentionSegment<'_, MlxKvLayer>],
    p: &AttentionParams,
) -> Result<Option<Array>> {
    let n = segments.len();
    if n < 2
        || p.window.is_some()
        || p.softcap.is_some()
        || segments
            .iter()
            .enumerate()
            .any(|(i, g)| g.rows != (i..i + 1))
    {
        return Ok(None);
    }
    let layers: Vec<&MlxKvLayer> = segments.iter().map(|g| &*g.cache).collect();
    let Some((batch, end)) = kv::lockstep(&layers) else {
        return Ok(None);
    };
    let (h, hk, hd) = (p.heads as i32, p.kv_heads as i32, p.head_dim as i32);
    let n32 = n as i32;
    let e = mlx_err;
    let k4 = s.reshape(k, &[n32, hk, 1, hd]).map_err(e)?;
    let v4 = s.reshape(v, &[n32, hk, 1, hd]).map_err(e)?;
    let q4 = s.reshape(q, &[n32, h, 1, hd]).map_err(e)?;
    let mut caches: Vec<&mut MlxKvLayer> = segments.iter_mut().map(|g| &mut *g.cache).collect();
    let (keys, values, pads) = MlxKvLayer::lockstep_step(&mut caches, &batch, end, &k4, &v4)?;
    let out = if pads.iter().any(|&pad| pad > 0) {
        let cols = end + 1;
        let visible: Vec<u8> = pads
            .iter()
            .flat_map(|&pad| (0..cols).map(move |j| (j >= pad) as u8))
            .collect();
        let m = Array::from_bytes(&visible, &[n32, 1, 1, cols as i32], Dtype::Bool).map_err(e)?;
        s.sdpa(&q4, &keys, &values, p.scale, AttentionMask::Array(&m))
            .map_err(e)?
    } else {
        s.sdpa(&q4, &keys, &values, p.scale, AttentionMask::None)
            .map_err(e)?
    };
    Ok(Some(s.reshape(&out, &[n32, h * hd]).map_err(e)?))
}

/// See the module docs; `q` `[n, H·D]`, `k`/`v` `[n, Hk·D]`, returns `[n, H·D]`.
pub(crate) fn attend(
    s: &Stream,
    q: &Array,
    k: &Array,
    v: &Array,
    segments: &mut [AttentionSegment<'_, MlxKvLayer>],
    p: &AttentionParams,
) -> Result<Array> {
    let (h, hk, hd) = (p.heads, p.kv_heads, p.head_dim);
    if let Some(out) = lockstep_decode(s, q, k, v, segments, p)? {
        return Ok(out);
    }
    let mut outs = Vec::with_capacity(segments.len());
    let single = segments.len() == 1;
    for seg in segments.iter_mut() {
        let (a, b) = (seg.rows.start, seg.rows.end);
        let m = b - a;
        let (qs, ks, vs) = if single {
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
        // Keys any of the new queries may see.
        let key_start = match p.window {
            Some(w) => (q_start + 1).saturating_sub(w).max(cache.start),
            None => cache.start,
        };
        let (keys, values) = cache.range(key_start, cache.len)?;
        let windowed = p.window.is_some_and(|w| m > 1 && cache.len - key_start > w);
        let out = if let Some(cap) = p.softcap {
            let visible = mask(q_start, m, key_start, cache.len, p.window)?;
            softcapped(s, &q4, &keys, &values, m, &visible, p, cap)?
        } else if m == 1 {
            s.sdpa(&q4, &keys, &values, p.scale, AttentionMask::None)
                .map_err(mlx_err)?
        } else if windowed {
            let visible = mask(q_start, m, key_start, cache.len, p.window)?;
            s.sdpa(&q4, &keys, &values, p.scale, AttentionMask::Array(&visible))
                .map_err(mlx_err)?
        } else {
            s.sdpa(&q4, &keys, &values, p.scale, AttentionMask::Causal)
                .map_err(mlx_err)?
        };
        let out = s.transpose(&out, &[0, 2, 1, 3]).map_err(mlx_err)?;
        outs.push(
            s.reshape(&out, &[m as i32, (h * hd) as i32])
                .map_err(mlx_err)?,
        );
        cache.evict()?;
    }
    if outs.len() == 1 {
        return Ok(outs.remove(0));
    }
    let refs: Vec<&Array> = outs.iter().collect();
    s.concatenate(&refs, 0).map_err(mlx_err)
}
