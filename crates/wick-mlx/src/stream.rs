//! Devices, streams and process-wide facts about the MLX runtime.
use std::ffi::CStr;

use crate::array::check;
use crate::error::Result;
use crate::ffi;

/// Where MLX runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// The CPU backend (reference BLAS in the `mlx-cpu` wheel).
    Cpu,
    /// The GPU backend of the installed wheel (CUDA with `mlx-cuda-13`, Metal on Apple).
    Gpu,
}

/// A queue of work on one device. Every operation names the stream it runs on; wick
/// makes one per backend instance, usable from any thread (the shim serializes calls).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    pub(crate) raw: ffi::wm_stream,
}

impl Stream {
    /// A new stream on `device`.
    pub fn new(device: Device) -> Result<Stream> {
        let mut raw = ffi::wm_stream {
            index: 0,
            device_type: 0,
            device_index: 0,
        };
        let code = match device {
            Device::Cpu => 0,
            Device::Gpu => 1,
        };
        // SAFETY: valid out pointer.
        check(unsafe { ffi::wm_new_stream(code, &mut raw) }, "new_stream")?;
        Ok(Stream { raw })
    }

    /// The stream's device.
    pub fn device(&self) -> Device {
        if self.raw.device_type == 1 {
            Device::Gpu
        } else {
            Device::Cpu
        }
    }

    /// Waits until everything queued on this stream has run.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: plain value argument.
        check(unsafe { ffi::wm_synchronize(self.raw) }, "synchronize")
    }
}

/// Whether the loaded MLX runtime has a GPU backend with a device present.
pub fn gpu_available() -> bool {
    let mut out = 0;
    // SAFETY: valid out pointer.
    let status = unsafe { ffi::wm_gpu_available(&mut out) };
    status == 0 && out == 1
}

/// The MLX runtime's version string (e.g. `0.32.4`).
pub fn version() -> String {
    // SAFETY: MLX returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(ffi::wm_version()) }
        .to_string_lossy()
        .into_owned()
}

/// MLX's allocator counters, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryStats {
    /// Held by live arrays.
    pub active: usize,
    /// Highest `active` so far.
    pub peak: usize,
    /// Freed buffers kept for reuse.
    pub cache: usize,
}

/// The allocator counters.
pub fn memory() -> Result<MemoryStats> {
    let mut m = MemoryStats::default();
    // SAFETY: valid out pointers.
    check(
        unsafe { ffi::wm_memory(&mut m.active, &mut m.peak, &mut m.cache) },
        "memory",
    )?;
    Ok(m)
}

/// A GPU's memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuMemory {
    /// All of it.
    pub total: usize,
    /// What this process could still allocate now.
    pub free: usize,
}

/// The first GPU's memory (`None` without a GPU). On CUDA the free figure is the
/// device's (NVML, else `cudaMemGetInfo`); on Metal the recommended working set less
/// MLX's live arrays. MLX's cached buffers count as used: [`clear_cache`] first to count
/// them free.
pub fn gpu_memory() -> Result<Option<GpuMemory>> {
    let mut m = GpuMemory::default();
    // SAFETY: valid out pointers.
    check(
        unsafe { ffi::wm_gpu_memory(&mut m.total, &mut m.free) },
        "gpu_memory",
    )?;
    Ok((m.total > 0).then_some(m))
}

/// Returns cached buffers to the system.
pub fn clear_cache() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { ffi::wm_clear_cache() }, "clear_cache")
}
