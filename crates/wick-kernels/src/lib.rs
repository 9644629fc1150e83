//! wick's CPU kernels: quantized matrix products over ggml weights, activation
//! quantization, fused elementwise ops and a low-latency thread pool.
//!
//! A weight matrix from a GGUF (or safetensors) file is repacked once, at load, into a
//! [`PackedMatrix`]: rows in strips of 16, the same four columns of all 16 rows next to
//! each other, quantized codes and scales kept as they were (same size as the file). A
//! product quantizes its input to 8 bits per 32-element block
//! ([`QuantizedActivations`]) and runs integer dot products of 16 rows at a time —
//! `vpdpbusd` on AVX-512 VNNI, `vpmaddubsw` on AVX2, plain Rust elsewhere, picked at run
//! time ([`Isa`]) — with every family giving bit-identical results. [`matmul`] spreads
//! one or several matrices sharing an input over a [`ThreadPool`]; the ops in
//! [`elementwise`] write into caller buffers. Nothing on the product path allocates once
//! the caller's buffers have grown to size.
//!
//! ```
//! use wick_kernels::{matmul, Isa, PackedMatrix, Product, QuantizedActivations, ThreadPool, WeightFormat};
//!
//! // A 16 × 32 Q8_0 matrix whose rows are all 1.0 (scale 1.0 as f16, codes 1).
//! let mut block = vec![0x00, 0x3C];
//! block.extend([1u8; 32]);
//! let bytes = block.repeat(16);
//! let w = PackedMatrix::from_ggml(WeightFormat::Q8_0, 16, 32, &bytes)?;
//! let x = vec![0.5f32; 32];
//! let mut out = vec![0f32; 16];
//! let mut act = QuantizedActivations::new();
//! let pool = ThreadPool::new(1);
//! matmul(&pool, Isa::best(), &x, 1, &mut [Product { weight: &w, out: &mut out, bias: None }], &mut act)?;
//! assert!(out.iter().all(|&v| (v - 16.0).abs() < 1e-3));
//! # Ok::<(), wick_kernels::KernelError>(())
//! ```
#![warn(missing_docs)]
// Block layouts are defined by index arithmetic; loops over indices state them directly.
#![allow(clippy::needless_range_loop)]

mod activation;
mod aligned;
pub mod amx;
pub mod elementwise;
mod error;
mod format;
pub mod ggml;
mod isa;
mod kernels;
mod lowrank;
mod matmul;
mod packed;
mod pool;
pub mod reference;

pub use activation::QuantizedActivations;
pub use aligned::{LineBuf, Plain};
pub use error::{KernelError, Result};
pub use format::WeightFormat;
pub use isa::Isa;
pub use lowrank::{low_rank_add, LowRankOutput, LowRankUpdate, MAX_LOW_RANK};
pub use matmul::{matmul, Product, MAX_PRODUCTS};
pub use packed::PackedMatrix;
pub use pool::ThreadPool;
