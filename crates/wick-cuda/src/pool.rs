//! The caching allocator: device buffers are kept by size class when freed and handed out
//! again, so a pass allocates nothing from the driver once it has run before, and the
//! same sequence of allocations gets the same addresses (see [`Pool::settle`]).
use std::collections::HashMap;

use cudarc::driver::{result, sys};

/// Bytes a request of `bytes` is rounded to: 256-byte steps up to 4 KiB, then steps of a
/// sixteenth of the next power of two (at most 12.5% more than asked, so that buffers of
/// similar sizes are shared).
pub(crate) fn class_of(bytes: usize) -> usize {
    let bytes = bytes.max(1);
    if bytes <= 4096 {
        return bytes.div_ceil(256) * 256;
    }
    let step = bytes.next_power_of_two() / 16;
    bytes.div_ceil(step) * step
}

#[derive(Default)]
pub(crate) struct Pool {
    free: HashMap<usize, Vec<sys::CUdeviceptr>>,
    /// Bytes taken from the driver, free or not.
    pub(crate) held: usize,
    /// Bytes of buffers in the free lists.
    pub(crate) cached: usize,
}

impl Pool {
    /// A free buffer of `class` bytes, if one is cached.
    pub(crate) fn take(&mut self, class: usize) -> Option<sys::CUdeviceptr> {
        let p = self.free.get_mut(&class)?.pop()?;
        self.cached -= class;
        Some(p)
    }

    pub(crate) fn give(&mut self, class: usize, ptr: sys::CUdeviceptr) {
        self.free.entry(class).or_default().push(ptr);
        self.cached += class;
    }

    /// Orders every free list so the lowest address is handed out first: two passes that
    /// start from the same free buffers and allocate alike get the same addresses, whatever
    /// order the previous pass freed them in.
    pub(crate) fn settle(&mut self) {
        for list in self.free.values_mut() {
            list.sort_unstable_by(|a, b| b.cmp(a));
        }
    }

    /// Gives every cached buffer back to the driver (the caller made sure no recorded work
    /// still refers to them). Returns the bytes released.
    pub(crate) fn release_cached(&mut self) -> usize {
        let mut released = 0;
        for (class, list) in self.free.drain() {
            for p in list {
                // SAFETY: the pointer came from `malloc_sync` and is in no one's hands.
                if unsafe { result::free_sync(p) }.is_ok() {
                    released += class;
                }
            }
        }
        self.held -= released.min(self.held);
        self.cached = 0;
        released
    }
}

#[cfg(test)]
mod tests {
    use super::class_of;

    #[test]
    fn classes_round_up_by_at_most_an_eighth() {
        assert_eq!(class_of(1), 256);
        assert_eq!(class_of(4096), 4096);
        assert_eq!(class_of(4097), 4608);
        for n in [5000usize, 65_537, 1 << 20, 3 << 20, 117_440_512] {
            let c = class_of(n);
            assert!(
                c >= n && (c - n) as f64 <= n as f64 / 8.0 + 1.0,
                "{n} -> {c}"
            );
            assert_eq!(class_of(c), c, "a class is its own class");
        }
    }
}
