//! wick-mlx: wick's binding to [MLX](https://github.com/ml-explore/mlx).
//!
//! A thin C++ shim (`src/shim/`) over the MLX C++ API is compiled against the MLX
//! runtime of the PyPI wheels (`mlx-cpu` for CI and CPUs, `mlx-cuda-13` for NVIDIA GPUs,
//! `mlx-metal` on Apple; one pinned version, see `build.rs`), and this crate wraps it
//! safely: [`Array`] handles, a [`Stream`] per device whose methods are the operations
//! (matrix products, MLX's affine quantized matmul, its fused `rms_norm`, `rope` and
//! scaled-dot-product attention …), and [`eval`] / [`async_eval`] to run the lazy graph.
//!
//! ```no_run
//! use wick_mlx::{Array, Device, Stream};
//! let s = Stream::new(Device::Cpu)?;
//! let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
//! let b = s.matmul(&a, &a)?;
//! assert_eq!(b.to_vec::<f32>()?, vec![7.0, 10.0, 15.0, 22.0]);
//! # Ok::<(), wick_mlx::MlxError>(())
//! ```
#![warn(missing_docs)]

mod array;
mod error;
#[allow(non_camel_case_types)]
mod ffi;
mod ops;
mod stream;

pub use array::{async_eval, eval, Array, Dtype, Element};
pub use error::{MlxError, Result};
pub use ops::{AttentionMask, DeltaStates, GatedDelta, GluActivation, Quantized, RopeOffset};
pub use stream::{
    clear_cache, gpu_available, gpu_memory, memory, version, Device, GpuMemory, MemoryStats, Stream,
};
