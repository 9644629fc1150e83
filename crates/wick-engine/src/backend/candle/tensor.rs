//! [`HostTensor`]: the CPU backend's activation, a row-major f32 matrix whose buffer is
//! recycled when the last handle drops, so a forward pass reuses the buffers of the
//! previous one instead of allocating (and page-faulting) fresh memory for every op.
use std::sync::{Arc, Mutex};

use crate::{EngineError, Result};

/// Free buffers kept for reuse, at most.
const MAX_FREE: usize = 64;
/// Bytes of free buffers kept, at most.
const MAX_FREE_BYTES: usize = 512 << 20;
/// Buffers larger than this are returned to the allocator. A lone prompt's chunks of
/// 2,048 rows make buffers of 80 MB (Qwen2.5-0.5B's fused gate and up projection) to
/// 235 MB (an 8B's): above glibc's largest mmap threshold (32 MB) each would otherwise
/// be mapped afresh, and every page faulted in and zeroed, at every layer.
const MAX_POOLED: usize = 256 << 20;

struct Recycler {
    free: Vec<Vec<f32>>,
    bytes: usize,
}

static RECYCLER: Mutex<Recycler> = Mutex::new(Recycler {
    free: Vec::new(),
    bytes: 0,
});

/// A buffer of `len` initialized floats (contents unspecified), recycled if possible;
/// it returns to the recycler when a [`HostTensor`] made from it drops.
pub(crate) fn buffer(len: usize) -> Vec<f32> {
    if let Ok(mut r) = RECYCLER.lock() {
        // Smallest free buffer that fits without wasting more than half of it.
        let best = r
            .free
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= len && v.capacity() <= 2 * len + 1024)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        if let Some(i) = best {
            let mut v = r.free.swap_remove(i);
            r.bytes -= v.capacity() * 4;
            drop(r);
            if v.len() >= len {
                v.truncate(len);
            } else {
                v.resize(len, 0.0);
            }
            return v;
        }
    }
    vec![0.0; len]
}

fn give(v: Vec<f32>) {
    let bytes = v.capacity() * 4;
    if bytes > MAX_POOLED || bytes == 0 {
        return;
    }
    if let Ok(mut r) = RECYCLER.lock() {
        while !r.free.is_empty() && (r.free.len() >= MAX_FREE || r.bytes + bytes > MAX_FREE_BYTES) {
            let old = r.free.remove(0);
            r.bytes -= old.capacity() * 4;
        }
        r.bytes += bytes;
        r.free.push(v);
    }
}

/// Owns a buffer and hands it back to the recycler when dropped.
struct Buffer(Vec<f32>);

impl Clone for Buffer {
    fn clone(&self) -> Self {
        let mut v = buffer(self.0.len());
        v.copy_from_slice(&self.0);
        Buffer(v)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

/// A `[rows, cols]` f32 activation in host memory. Cloning shares the buffer.
#[derive(Clone)]
pub struct HostTensor {
    buf: Arc<Buffer>,
    rows: usize,
    cols: usize,
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostTensor[{}, {}]", self.rows, self.cols)
    }
}

impl HostTensor {
    /// Wraps `data` (`rows × cols` floats).
    pub fn from_vec(data: Vec<f32>, rows: usize, cols: usize) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(EngineError::Backend {
                backend: "cpu",
                message: format!("{} floats for a [{rows}, {cols}] tensor", data.len()),
            });
        }
        Ok(HostTensor {
            buf: Arc::new(Buffer(data)),
            rows,
            cols,
        })
    }

    /// A new `[rows, cols]` tensor in a recycled buffer, filled by `fill` (which must
    /// write every element: the buffer holds stale values).
    pub(crate) fn build(
        rows: usize,
        cols: usize,
        fill: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Self> {
        let mut data = buffer(rows * cols);
        let filled = fill(&mut data);
        let t = HostTensor {
            buf: Arc::new(Buffer(data)),
            rows,
            cols,
        };
        filled.map(|()| t)
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The values, row-major.
    pub fn data(&self) -> &[f32] {
        &self.buf.0
    }

    /// The values, writable: the buffer is copied first if another handle shares it.
    pub(crate) fn data_mut(&mut self) -> &mut [f32] {
        &mut Arc::make_mut(&mut self.buf).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_buffers_come_back_and_sizes_are_exact() {
        let a = HostTensor::build(4, 1000, |d| {
            d.fill(1.0);
            Ok(())
        })
        .unwrap();
        assert_eq!(a.data().len(), 4000);
        drop(a);
        let b = HostTensor::build(3, 1000, |d| {
            d.fill(2.0);
            Ok(())
        })
        .unwrap();
        assert_eq!(b.data().len(), 3000);
        assert!(b.data().iter().all(|&v| v == 2.0));
        assert!(HostTensor::from_vec(vec![0.0; 5], 2, 3).is_err());
    }

    #[test]
    fn writing_a_shared_tensor_copies_it() {
        let a = HostTensor::from_vec(vec![1.0; 6], 2, 3).unwrap();
        let mut b = a.clone();
        b.data_mut()[0] = 5.0;
        assert_eq!(a.data()[0], 1.0);
        assert_eq!(b.data(), &[5.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    }
}
