//! glibc's malloc told to keep freed memory for reuse.
//!
//! Every forward pass allocates its activations afresh: a 512-row prompt chunk of
//! Qwen2.5-0.5B needs several 10 MB buffers per layer, a training step gigabytes. By
//! default glibc serves each request above its mmap threshold (128 KiB, raised on the fly
//! up to 32 MiB) with a fresh mapping it unmaps on free, and trims the heap top past
//! 128 KiB, so the next pass faults the same amount of memory in again and the kernel
//! zeroes every page of it (2 MiB at a time on huge pages). With the threshold at glibc's
//! ceiling (32 MiB) and trimming left to a large threshold, freed buffers stay in the heap
//! and the next pass reuses them: the process keeps its peak resident size instead of
//! returning it between passes, as a server that preallocates its compute buffers would.
//!
//! Measured (`wick bench qwen2.5-coder --case 4096:1:1 --prefill-chunk 512`): page faults
//! of the whole process 17.2k → 9.8k. `WICK_RETAIN_HEAP=0` leaves glibc's defaults.

/// Raises glibc's mmap and trim thresholds (no-op elsewhere, or with
/// `WICK_RETAIN_HEAP=0`). Call it first in `main`, before other threads start.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("WICK_RETAIN_HEAP").is_some_and(|v| v == "0") {
            return;
        }
        /// glibc's largest accepted mmap threshold (`HEAP_MAX_SIZE / 2` on 64-bit).
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        /// Heap top kept before trimming.
        const TRIM_THRESHOLD: libc::c_int = 1 << 30;
        // SAFETY: `mallopt` only changes malloc's parameters; it is called before any
        // other thread exists. A refused value (return 0) leaves the default in place.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
        }
    }
}
