//! wick-cuda: the device layer of wick's CUDA backend.
//!
//! One [`Device`] owns a CUDA context, one stream, wick's kernels (CUDA C in
//! `kernels.cu`, compiled by NVRTC for the device at start-up), a cuBLAS handle and a
//! caching allocator. The CUDA libraries are loaded at run time, so this crate builds and
//! links on machines without CUDA; [`Device::new`] says what is missing.
//!
//! Work is *recorded*, not launched: every launch, copy and product becomes an entry of the
//! current pass's tape, and the tape runs when its results are needed (a download, the end
//! of the pass). A pass whose tape repeats exactly — the same kernels on the same buffers
//! with the same shapes, which is what a decode step of a fixed batch is once step-varying
//! values (token ids, rotary angles, cache lengths) travel as uploaded data rather than
//! arguments — is captured as a CUDA graph on its third occurrence and replayed from then
//! on, so the host pays one graph launch instead of hundreds of kernel launches.
//!
//! Reusing memory inside a pass is safe because everything runs in order on one stream: a
//! buffer freed after the entries that use it were recorded is only handed to entries
//! recorded later, which run later.
//!
//! ```no_run
//! use wick_cuda::{Arg, Device, Kernel};
//! let dev = Device::new(0)?;
//! let x = dev.upload(bytemuck::cast_slice(&[1.0f32, 2.0, 3.0]))?;
//! let y = dev.alloc(12)?;
//! dev.launch(Kernel::Scale, (1, 1, 1), 32, &[Arg::Ptr(x.ptr()), Arg::Ptr(y.ptr()), Arg::F32(2.0), Arg::I64(3)])?;
//! let back: Vec<f32> = bytemuck::cast_slice(&dev.download(y.ptr(), 12)?).to_vec();
//! assert_eq!(back, [2.0, 4.0, 6.0]);
//! # Ok::<(), wick_cuda::CudaError>(())
//! ```
#![warn(missing_docs)]

mod device;
mod pool;

pub use device::{Arg, Buffer, Device, Gemm, Kernel, Readback, Stats, WType};

/// What can go wrong on the device.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The CUDA libraries are not there (no driver, or no CUDA 13 runtime libraries on the
    /// library path).
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// NVRTC could not compile the kernels.
    #[error("compiling the CUDA kernels: {0}")]
    Compile(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// A caller's mistake (sizes, ranges).
    #[error("{0}")]
    Invalid(String),
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, CudaError>;

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(format!("{e:?}"))
    }
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        CudaError::Blas(format!("{e:?}"))
    }
}
