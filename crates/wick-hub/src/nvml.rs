//! GPU memory through NVML (`libnvidia-ml.so.1`), opened at run time: a machine without
//! the NVIDIA driver simply has no GPU here.
use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::fit::Gpu;

#[repr(C)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

type Init = unsafe extern "C" fn() -> c_int;
type HandleByIndex = unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_int;
type MemoryInfo = unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_int;
type Name = unsafe extern "C" fn(*mut c_void, *mut c_char, c_uint) -> c_int;
type Shutdown = unsafe extern "C" fn() -> c_int;

/// The first GPU's name and memory, when NVML is present and answers.
pub(crate) fn first_gpu() -> Option<Gpu> {
    // SAFETY: loading the NVIDIA management library runs its initialisers, which have no
    // preconditions; the symbols are looked up with the signatures NVML documents.
    unsafe {
        let lib = libloading::Library::new("libnvidia-ml.so.1").ok()?;
        let init: libloading::Symbol<Init> = lib.get(b"nvmlInit_v2\0").ok()?;
        let by_index: libloading::Symbol<HandleByIndex> =
            lib.get(b"nvmlDeviceGetHandleByIndex_v2\0").ok()?;
        let memory: libloading::Symbol<MemoryInfo> = lib.get(b"nvmlDeviceGetMemoryInfo\0").ok()?;
        let name: libloading::Symbol<Name> = lib.get(b"nvmlDeviceGetName\0").ok()?;
        let shutdown: libloading::Symbol<Shutdown> = lib.get(b"nvmlShutdown\0").ok()?;
        if init() != 0 {
            return None;
        }
        let mut handle: *mut c_void = std::ptr::null_mut();
        let mut gpu = None;
        if by_index(0, &mut handle) == 0 {
            let mut mem = NvmlMemory {
                total: 0,
                free: 0,
                used: 0,
            };
            let mut buf = [0 as c_char; 96];
            if memory(handle, &mut mem) == 0
                && name(handle, buf.as_mut_ptr(), buf.len() as c_uint) == 0
            {
                let name = std::ffi::CStr::from_ptr(buf.as_ptr())
                    .to_string_lossy()
                    .into_owned();
                gpu = Some(Gpu {
                    name,
                    memory_bytes: mem.total,
                    free_bytes: mem.free,
                });
            }
        }
        shutdown();
        gpu
    }
}
