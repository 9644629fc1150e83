//! Batched decode on MLX: the sequences of a decode step move their keys and values into
//! the rows of one buffer per layer, `[rows, kv_heads, columns, head_dim]`, right-aligned
//! so that every row taking part ends in the same column. A step of `n` sequences is then
//! one write and one attention call per layer, whatever `n` is, instead of a dozen graph
//! nodes per sequence.
//!
//! Sequences join and leave as the scheduler admits and finishes them:
//! - a sequence not yet in the arena (fresh from its prefill, or out of step with it) is
//!   copied into a free row, padded on the left to end where the others end;
//! - a row whose sequence is dropped becomes free ([`ArenaRow`]'s `Drop`); a row that
//!   misses a step stays intact (the step writes past its end) and is copied anew when it
//!   next takes part;
//! - when every live row takes part, free rows and the padding all rows share are
//!   squeezed out (one gather), so the buffer follows the batch down as well as up.
//!
//! Under a KV pool with a budget, each row's sequence is charged the buffer's columns
//! (`kv.rs`); the buffer then grows by exactly the rows that join rather than doubling,
//! and squeezes out a free row at the next step where every live row takes part, so
//! rows nobody is charged for do not outlive a step.
//!
//! The cost of a row is its padding: each step reads the columns from the row's start of
//! padding to the end. Prompts of similar length waste little; a sequence far shorter than
//! the longest reads the longest's length.
use std::sync::{Arc, Mutex};

use wick_mlx::{Array, AttentionMask, Dtype, Stream};

use super::kv::{MlxKvLayer, Storage};
use super::mlx_err;
use crate::backend::{AttentionParams, KvLayer};
use crate::{EngineError, Result};

/// Columns a buffer grows by.
const COLUMNS: usize = 256;

/// One layer's buffer shared by the sequences decoded together.
#[derive(Debug)]
pub(crate) struct Arena {
    stream: Stream,
    dtype: Dtype,
    kv_heads: usize,
    head_dim: usize,
    keys: Option<Array>,
    values: Option<Array>,
    /// Columns allocated.
    capacity: usize,
    /// The column the next step writes; aligned rows end just before it.
    end: usize,
    /// Per row: the column its sequence's first token is in, or `None` when free.
    pads: Vec<Option<usize>>,
}

/// A sequence's place in an arena; frees the row when dropped.
#[derive(Debug)]
pub(crate) struct ArenaRow {
    pub(crate) arena: Arc<Mutex<Arena>>,
    pub(crate) row: usize,
}

impl Drop for ArenaRow {
    fn drop(&mut self) {
        if let Ok(mut a) = self.arena.lock() {
            if let Some(pad) = a.pads.get_mut(self.row) {
                *pad = None;
            }
        }
    }
}

pub(crate) fn poisoned() -> EngineError {
    EngineError::Cache("mlx: a batch KV buffer's lock was poisoned".into())
}

impl Arena {
    fn new(stream: Stream, dtype: Dtype, kv_heads: usize, head_dim: usize) -> Self {
        Arena {
            stream,
            dtype,
            kv_heads,
            head_dim,
            keys: None,
            values: None,
            capacity: 0,
            end: 0,
            pads: Vec::new(),
        }
    }

    fn shape(&self, rows: usize, columns: usize) -> [i32; 4] {
        [
            rows as i32,
            self.kv_heads as i32,
            columns as i32,
            self.head_dim as i32,
        ]
    }

    /// Columns `from..to` of `row`'s sequence (logical offsets from its first stored
    /// token), keys and values `[1, kv_heads, to - from, head_dim]`.
    pub(crate) fn row_range(&self, row: usize, from: usize, to: usize) -> Result<(Array, Array)> {
        let (Some(k), Some(v), Some(Some(pad))) = (&self.keys, &self.values, self.pads.get(row))
        else {
            return Err(EngineError::Cache("mlx: the batch KV row is empty".into()));
        };
        let start = [row as i32, 0, (pad + from) as i32, 0];
        let mut stop = self.shape(row + 1, pad + to);
        stop[0] = row as i32 + 1;
        let s = &self.stream;
        Ok((
            s.slice(k, &start, &stop).map_err(mlx_err)?,
            s.slice(v, &start, &stop).map_err(mlx_err)?,
        ))
    }

    /// Columns allocated (every row has them all).
    pub(crate) fn columns(&self) -> usize {
        self.capacity
    }

    /// Columns allocated once the next step wrote its column.
    pub(crate) fn columns_after_step(&self) -> usize {
        self.capacity
            .max((self.end + 1).div_ceil(COLUMNS) * COLUMNS)
    }

    /// Whether `row` holds a sequence of `stored` tokens ending where the next step writes.
    fn is_aligned(&self, row: usize, stored: usize) -> bool {
        stored <= self.end && self.pads.get(row) == Some(&Some(self.end - stored))
    }

    /// New buffers of `rows` × `capacity` holding the old rows' columns `0..end`, moved
    /// right by `shift`.
    fn relayout(&mut self, rows: usize, capacity: usize, shift: usize) -> Result<()> {
        let s = self.stream;
        let shape = self.shape(rows, capacity);
        let kept = self.shape(self.pads.len(), self.end);
        let has_columns = self.end > 0 && !self.pads.is_empty();
        for buf in [&mut self.keys, &mut self.values] {
            let part = match buf.take() {
                Some(old) if has_columns => Some(s.slice(&old, &[0; 4], &kept).map_err(mlx_err)?),
                _ => None,
            };
            *buf = Some(placed(&s, self.dtype, shape, part.as_ref(), shift)?);
        }
        self.capacity = capacity;
        self.end += shift;
        for pad in self.pads.iter_mut().flatten() {
            *pad += shift;
        }
        self.pads.resize(rows.max(self.pads.len()), None);
        Ok(())
    }

    /// Room for `joining` more rows, sequences of up to `longest` tokens, and one more
    /// column. Spare rows (doubling, so that joins rarely copy the buffer) only when
    /// `exact` is false: under a budget every row must belong to a charged sequence.
    fn make_room(&mut self, joining: usize, longest: usize, exact: bool) -> Result<()> {
        let free = self.pads.iter().filter(|p| p.is_none()).count();
        let rows = self.pads.len();
        let rows = if free >= joining {
            rows
        } else if exact {
            rows + joining - free
        } else {
            (rows + joining - free).max(2 * rows)
        };
        let shift = longest.saturating_sub(self.end);
        let columns = (self.end + shift + 1).div_ceil(COLUMNS) * COLUMNS;
        if rows != self.pads.len() || shift > 0 || columns > self.capacity {
            self.relayout(rows, columns.max(self.capacity), shift)?;
        }
        Ok(())
    }

    /// Writes a sequence of `stored` tokens (keys and values `[1, kvh, stored, hd]`, or
    /// nothing when `stored` is 0) into a free row, ending at `end`; returns the row.
    fn join(&mut self, kv: Option<(Array, Array)>, stored: usize) -> Result<usize> {
        let row = self
            .pads
            .iter()
            .position(Option::is_none)
            .ok_or_else(|| EngineError::Cache("mlx: no free batch KV row".into()))?;
        let pad = self.end - stored;
        if let Some((k, v)) = kv {
            let s = &self.stream;
            let start = [row as i32, 0, pad as i32, 0];
            let mut stop = self.shape(row + 1, self.end);
            stop[0] = row as i32 + 1;
            for (buf, new) in [(&mut self.keys, k), (&mut self.values, v)] {
                let old = buf
                    .take()
                    .ok_or_else(|| EngineError::Cache("mlx: batch KV buffer missing".into()))?;
                *buf = Some(s.slice_update(&old, &new, &start, &stop).map_err(mlx_err)?);
            }
        }
        self.pads[row] = Some(pad);
        Ok(row)
    }

    /// When `rows` (the participants, in order) are every live row: keeps only them, in
    /// that order, and drops the columns of padding they all share, if that frees a
    /// quarter of the rows (any row when `eager`) or a block of columns. Returns whether
    /// it did.
    fn squeeze(&mut self, rows: &[usize], eager: bool) -> Result<bool> {
        let live = self.pads.iter().filter(|p| p.is_some()).count();
        let free = self.pads.len() - live;
        let lead = rows.iter().filter_map(|&r| self.pads[r]).min().unwrap_or(0);
        let enough_rows = if eager {
            free > 0
        } else {
            free >= (self.pads.len() / 4).max(1)
        };
        if live != rows.len() || (!enough_rows && lead < COLUMNS) {
            return Ok(false);
        }
        let s = self.stream;
        let index = index_array(rows)?;
        let n = rows.len();
        let used = self.end - lead;
        let capacity = (used + 1).div_ceil(COLUMNS) * COLUMNS;
        let shape = self.shape(n, capacity);
        let (mut from, to) = ([0; 4], self.shape(n, self.end));
        from[2] = lead as i32;
        for buf in [&mut self.keys, &mut self.values] {
            let part = match buf.take() {
                Some(old) => {
                    let picked = s.take(&old, &index, 0).map_err(mlx_err)?;
                    Some(s.slice(&picked, &from, &to).map_err(mlx_err)?)
                }
                None => None,
            };
            *buf = Some(placed(&s, self.dtype, shape, part.as_ref(), 0)?);
        }
        self.pads = rows
            .iter()
            .map(|&r| self.pads[r].map(|p| p - lead))
            .collect();
        self.end = used;
        self.capacity = capacity;
        Ok(true)
    }
}

/// A zero buffer of `shape` with `part` (same rows, heads and head size) written from
/// column `column` on.
fn placed(
    s: &Stream,
    dtype: Dtype,
    shape: [i32; 4],
    part: Option<&Array>,
    column: usize,
) -> Result<Array> {
    let fresh = s.zeros(&shape, dtype).map_err(mlx_err)?;
    let Some(part) = part else {
        return Ok(fresh);
    };
    let &[rows, heads, columns, dim] = part.shape().as_slice() else {
        return Err(EngineError::Cache("mlx: a KV part is not 4-D".into()));
    };
    let at = column as i32;
    let stop = [rows, heads, at + columns, dim];
    s.slice_update(&fresh, part, &[0, 0, at, 0], &stop)
        .map_err(mlx_err)
}

/// `rows` as an MLX index vector.
fn index_array(rows: &[usize]) -> Result<Array> {
    let index: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
    Array::from_slice(&index, &[index.len() as i32]).map_err(mlx_err)
}

/// Visibility `[rows, 1, 1, end + 1]` for a step: row `r` sees its own columns when it
/// takes part, only the new column otherwise (its output is discarded; this keeps the
/// softmax finite). `None` when every row sees everything.
fn step_mask(pads: &[Option<usize>], taking_part: &[bool], end: usize) -> Result<Option<Array>> {
    let full = pads
        .iter()
        .zip(taking_part)
        .all(|(p, &t)| t && *p == Some(0));
    if full {
        return Ok(None);
    }
    let cols = end + 1;
    let mut visible = Vec::with_capacity(pads.len() * cols);
    for (pad, &t) in pads.iter().zip(taking_part) {
        let from = match (t, pad) {
            (true, Some(p)) => *p,
            _ => end,
        };
        visible.extend((0..cols).map(|j| (j >= from) as u8));
    }
    let shape = [pads.len() as i32, 1, 1, cols as i32];
    Array::from_bytes(&visible, &shape, Dtype::Bool)
        .map(Some)
        .map_err(mlx_err)
}

/// Rows of `x` (first axis) at `index`, or `x` itself when `index` is `0..n` of an `n`-row
/// `x`.
pub(crate) fn gather(s: &Stream, x: &Array, index: &[usize]) -> Result<Array> {
    let rows = x.shape().first().copied().unwrap_or(0) as usize;
    if rows == index.len() && index.iter().enumerate().all(|(i, &r)| i == r) {
        return Ok(x.clone());
    }
    s.take(x, &index_array(index)?, 0).map_err(mlx_err)
}

/// Whether this layer is a row of a batch buffer (its decode steps then stay batched, even
/// alone, rather than copying it out).
pub(crate) fn in_arena(layer: &MlxKvLayer) -> bool {
    matches!(layer.storage, Storage::Row(_))
}

/// One decode step of `layers` (one new token each): `q` `[n, H·D]`, `k`/`v` `[n, Hk·D]`
/// in the order of `layers`; returns `[n, H·D]`.
pub(crate) fn decode_step(
    s: &Stream,
    layers: &mut [&mut MlxKvLayer],
    q: &Array,
    k: &Array,
    v: &Array,
    p: &AttentionParams,
) -> Result<Array> {
    let n = layers.len();
    let proto = layers
        .first()
        .ok_or_else(|| EngineError::Cache("mlx: empty decode step".into()))?;
    // The arena of the first participant already in step with one, else a new one.
    let mut arena = None;
    for l in layers.iter() {
        if let Storage::Row(r) = &l.storage {
            if r.arena
                .lock()
                .map_err(|_| poisoned())?
                .is_aligned(r.row, l.stored())
            {
                arena = Some(r.arena.clone());
                break;
            }
        }
    }
    let arena = arena.unwrap_or_else(|| {
        Arc::new(Mutex::new(Arena::new(
            *s,
            proto.dtype,
            proto.kv_heads,
            proto.head_dim,
        )))
    });
    // Everyone else leaves what they were in, taking their keys and values along.
    let mut joining = Vec::new();
    for (i, l) in layers.iter_mut().enumerate() {
        let stays = match &l.storage {
            Storage::Row(r) if Arc::ptr_eq(&r.arena, &arena) => r
                .arena
                .lock()
                .map_err(|_| poisoned())?
                .is_aligned(r.row, l.stored()),
            _ => false,
        };
        if !stays {
            let stored = l.stored();
            let kv = if stored > 0 {
                Some(l.range(l.start, l.len)?)
            } else {
                None
            };
            l.storage = Storage::empty();
            joining.push((i, kv, stored));
        }
    }
    // Under a budget the buffer holds only charged rows (see the module docs).
    let bounded = layers.iter().any(|l| l.in_bounded_pool());
    let mut guard = arena.lock().map_err(|_| poisoned())?;
    let a = &mut *guard;
    let longest = joining.iter().map(|j| j.2).max().unwrap_or(0);
    a.make_room(joining.len(), longest, bounded)?;
    for (i, kv, stored) in joining {
        let row = a.join(kv, stored)?;
        layers[i].storage = Storage::Row(ArenaRow {
            arena: arena.clone(),
            row,
        });
    }
    let mut rows = row_of(layers)?;
    if a.squeeze(&rows, bounded)? {
        for (i, l) in layers.iter_mut().enumerate() {
            if let Storage::Row(r) = &mut l.storage {
                r.row = i;
            }
        }
        rows = (0..n).collect();
    }

    let (h, hk, hd) = (p.heads as i32, p.kv_heads as i32, p.head_dim as i32);
    let e = mlx_err;
    let total = a.pads.len();
    // Row r of the buffer ← participant `source[r]` (participant 0 for rows not taking
    // part: their new column is never read).
    let mut source = vec![0; total];
    let mut taking_part = vec![false; total];
    for (i, &r) in rows.iter().enumerate() {
        source[r] = i;
        taking_part[r] = true;
    }
    let k4 = gather(
        s,
        &s.reshape(k, &[n as i32, hk, 1, hd]).map_err(e)?,
        &source,
    )?;
    let v4 = gather(
        s,
        &s.reshape(v, &[n as i32, hk, 1, hd]).map_err(e)?,
        &source,
    )?;
    let q4 = gather(s, &s.reshape(q, &[n as i32, h, 1, hd]).map_err(e)?, &source)?;
    let end = a.end;
    let start = [0, 0, end as i32, 0];
    let stop = a.shape(total, end + 1);
    let mut written = Vec::with_capacity(2);
    for (buf, new) in [(&mut a.keys, &k4), (&mut a.values, &v4)] {
        let old = buf
            .take()
            .ok_or_else(|| EngineError::Cache("mlx: batch KV buffer missing".into()))?;
        let updated = s.slice_update(&old, new, &start, &stop).map_err(e)?;
        written.push(s.slice(&updated, &[0; 4], &stop).map_err(e)?);
        *buf = Some(updated);
    }
    let mask = step_mask(&a.pads, &taking_part, end)?;
    a.end += 1;
    drop(guard);
    let mask = match &mask {
        Some(m) => AttentionMask::Array(m),
        None => AttentionMask::None,
    };
    let out = s
        .sdpa(&q4, &written[0], &written[1], p.scale, mask)
        .map_err(e)?;
    let out = gather(s, &out, &rows)?;
    for l in layers.iter_mut() {
        l.len += 1;
        // The row's charge follows the buffer's columns.
        l.settle();
    }
    s.reshape(&out, &[n as i32, h * hd]).map_err(e)
}

/// The arena row of each layer (all are in one by now).
fn row_of(layers: &[&mut MlxKvLayer]) -> Result<Vec<usize>> {
    layers
        .iter()
        .map(|l| match &l.storage {
            Storage::Row(r) => Ok(r.row),
            Storage::Own { .. } => Err(EngineError::Cache(
                "mlx: a sequence of a batched step is not in its buffer".into(),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use wick_mlx::{Array, Device, Dtype, Stream};

    use super::*;
    use crate::backend::KvLayer;
    use crate::kv_pool::BlockPool;

    const KVH: usize = 2;
    const HD: usize = 8;

    fn params() -> AttentionParams {
        AttentionParams {
            heads: KVH,
            kv_heads: KVH,
            head_dim: HD,
            scale: 0.5,
            window: None,
            softcap: None,
        }
    }

    /// A layer holding `tokens` tokens, attached to `pool`.
    fn layer(s: Stream, tokens: usize, pool: &Arc<BlockPool>) -> MlxKvLayer {
        let mut l = MlxKvLayer::new(s, Dtype::F32, KVH, HD, None);
        l.attach(pool);
        let shape = [1, KVH as i32, tokens as i32, HD as i32];
        let k = s.zeros(&shape, Dtype::F32).unwrap();
        l.append(&k, &k, tokens).unwrap();
        l
    }

    /// One batched decode step of `layers`.
    fn step(s: Stream, layers: &mut [&mut MlxKvLayer]) {
        let n = layers.len();
        let x = Array::from_slice(&vec![0.25f32; n * KVH * HD], &[n as i32, (KVH * HD) as i32])
            .unwrap();
        decode_step(&s, layers, &x, &x, &x, &params()).unwrap();
    }

    fn rows_and_columns(l: &MlxKvLayer) -> (usize, usize) {
        let Storage::Row(r) = &l.storage else {
            panic!("not in a batch buffer")
        };
        let a = r.arena.lock().unwrap();
        (a.pads.len(), a.capacity)
    }

    #[test]
    fn own_buffers_are_charged_their_capacity() {
        let s = Stream::new(Device::Cpu).unwrap();
        let pool = BlockPool::new(1000);
        let mut l = layer(s, 10, &pool);
        // 256 columns = 16 blocks of 16 tokens.
        assert_eq!(pool.used(), 16);
        assert_eq!(l.extra_blocks_for(246), 0);
        assert_eq!(l.extra_blocks_for(247), 16);
        // A chunk that overflows the partly filled buffer keeps what it held.
        let twos = Array::from_slice(
            &vec![2f32; KVH * 250 * HD],
            &[1, KVH as i32, 250, HD as i32],
        )
        .unwrap();
        l.append(&twos, &twos, 250).unwrap();
        assert_eq!(pool.used(), 32);
        let keys = l.snapshot().keys;
        assert_eq!(keys.len(), 260 * KVH * HD);
        assert!(keys[..10 * KVH * HD].iter().all(|&x| x == 0.0));
        assert!(keys[10 * KVH * HD..].iter().all(|&x| x == 2.0));
        let clone = l.clone();
        assert_eq!(pool.used(), 32, "clones are not charged");
        drop(l);
        assert_eq!(pool.used(), 0);
        assert_eq!(clone.len, 260);
    }

    #[test]
    fn batch_rows_are_charged_the_buffer_and_a_budget_keeps_no_spare_rows() {
        let s = Stream::new(Device::Cpu).unwrap();
        let pool = BlockPool::new(100_000);
        assert!(pool.is_bounded());
        let mut a = layer(s, 300, &pool);
        let mut b = layer(s, 5, &pool);
        assert_eq!(pool.used(), 32 + 16);
        step(s, &mut [&mut a, &mut b]);
        // Both rows have the buffer's 512 columns (the longer one's 301 rounded up).
        assert_eq!(rows_and_columns(&a), (2, 512));
        assert_eq!(pool.used(), 2 * 32);
        // A third joins: exactly one more row, every row charged.
        let mut c = layer(s, 7, &pool);
        step(s, &mut [&mut a, &mut b, &mut c]);
        assert_eq!(rows_and_columns(&a), (3, 512));
        assert_eq!(pool.used(), 3 * 32);
        // The long one leaves: its charge goes at once, its row at the next step.
        drop(a);
        assert_eq!(pool.used(), 2 * 32);
        step(s, &mut [&mut b, &mut c]);
        let (rows, columns) = rows_and_columns(&b);
        assert_eq!(rows, 2);
        assert_eq!(pool.used(), 2 * columns / 16);
        // Leaving the batch (into the prompt cache) moves to buffers of its own.
        b.detach();
        b.leave_batch();
        assert_eq!(pool.used(), columns / 16);
        assert!(matches!(b.storage, Storage::Own { .. }));
    }

    /// An arena of `rows` rows, all live, sequences of one token.
    fn arena_of(s: Stream, rows: usize) -> Arena {
        let mut a = Arena::new(s, Dtype::F32, KVH, HD);
        a.make_room(rows, 1, true).unwrap();
        let one = s.zeros(&[1, KVH as i32, 1, HD as i32], Dtype::F32).unwrap();
        for _ in 0..rows {
            a.join(Some((one.clone(), one.clone())), 1).unwrap();
        }
        a
    }

    #[test]
    fn spare_rows_only_without_a_budget() {
        let s = Stream::new(Device::Cpu).unwrap();
        let mut a = arena_of(s, 2);
        a.make_room(1, 0, false).unwrap();
        assert_eq!(a.pads.len(), 4, "doubles without a budget");
        let mut b = arena_of(s, 2);
        b.make_room(1, 0, true).unwrap();
        assert_eq!(b.pads.len(), 3, "exactly the rows that join under one");
    }

    #[test]
    fn under_a_budget_one_free_row_is_squeezed_out() {
        let s = Stream::new(Device::Cpu).unwrap();
        let mut a = arena_of(s, 8);
        a.pads[3] = None;
        let live: Vec<usize> = (0..8).filter(|&r| r != 3).collect();
        assert!(
            !a.squeeze(&live, false).unwrap(),
            "one row of eight is kept spare"
        );
        assert!(a.squeeze(&live, true).unwrap());
        assert_eq!(a.pads.len(), 7);
    }
}
