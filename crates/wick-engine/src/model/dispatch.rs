//! The decoder and the caches on whichever backend the model was loaded onto.
use super::DeviceMemory;
use crate::backend::candle::{CandleBackend, KvDtype};
#[cfg(feature = "cuda")]
use crate::backend::cuda::CudaBackend;
#[cfg(feature = "mlx")]
use crate::backend::mlx::MlxBackend;
use crate::backend::{Backend, KvLayer};
use crate::models::decoder::{Decoder, SequenceCache};
#[cfg(any(feature = "mlx", feature = "cuda"))]
use crate::EngineError;
use crate::Result;

/// Most blocks a layer (of a sliding window, if any) holds for a sequence of so many
/// tokens fed so many at a time: [`KvLayer::peak_blocks`] of one backend.
pub(crate) type PeakBlocks = fn(usize, Option<usize>, usize) -> usize;

/// The decoder on the backend the model was loaded onto.
// One per loaded model: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum AnyDecoder {
    Candle(Decoder<CandleBackend>),
    #[cfg(feature = "mlx")]
    Mlx(Decoder<MlxBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Decoder<CudaBackend>),
}

impl AnyDecoder {
    /// How the CPU backend's KV cache stores numbers; `None` on MLX, which keeps the
    /// checkpoint's compute type.
    pub(crate) fn kv_dtype(&self) -> Option<KvDtype> {
        match self {
            AnyDecoder::Candle(d) => Some(d.backend().kv_dtype()),
            #[cfg(feature = "mlx")]
            AnyDecoder::Mlx(_) => None,
            #[cfg(feature = "cuda")]
            AnyDecoder::Cuda(d) => Some(d.backend().kv_dtype()),
        }
    }

    /// Bytes of one number of the KV cache: the CPU backend's KV type, or on MLX the
    /// activation type the caches keep.
    pub(crate) fn kv_number_bytes(&self) -> usize {
        match self {
            AnyDecoder::Candle(d) => d.backend().kv_dtype().bytes(),
            #[cfg(feature = "mlx")]
            AnyDecoder::Mlx(d) => d.backend().dtype().size(),
            #[cfg(feature = "cuda")]
            AnyDecoder::Cuda(d) => d.backend().kv_dtype().bytes(),
        }
    }

    /// [`KvLayer::peak_blocks`] of the backend's KV layers.
    pub(crate) fn kv_peak_blocks(&self) -> PeakBlocks {
        match self {
            AnyDecoder::Candle(_) => <crate::backend::candle::CpuKvLayer as KvLayer>::peak_blocks,
            #[cfg(feature = "mlx")]
            AnyDecoder::Mlx(_) => <crate::backend::mlx::MlxKvLayer as KvLayer>::peak_blocks,
            #[cfg(feature = "cuda")]
            AnyDecoder::Cuda(_) => <crate::backend::cuda::CudaKvLayer as KvLayer>::peak_blocks,
        }
    }

    /// The accelerator memory the KV cache lives in, when it is not host RAM: `None` on
    /// the CPU (candle, or MLX on its CPU device).
    pub(crate) fn device_memory(&self) -> Option<DeviceMemory> {
        match self {
            AnyDecoder::Candle(_) => None,
            #[cfg(feature = "mlx")]
            AnyDecoder::Mlx(d) => {
                if d.backend().device() != crate::backend::mlx::MlxDevice::Gpu {
                    return None;
                }
                // Buffers MLX cached while loading are free for the KV cache to take.
                if let Err(e) = wick_mlx::clear_cache() {
                    tracing::warn!("MLX clear_cache: {e}");
                }
                match wick_mlx::gpu_memory() {
                    Ok(m) => m.map(|m| DeviceMemory {
                        total: m.total as u64,
                        free: m.free as u64,
                    }),
                    Err(e) => {
                        tracing::warn!("cannot read the GPU's memory: {e}");
                        None
                    }
                }
            }
            #[cfg(feature = "cuda")]
            AnyDecoder::Cuda(d) => match d.backend().device().memory() {
                Ok((free, total)) => {
                    // Buffers the allocator caches are free for the KV cache to take.
                    let cached = d.backend().device().stats().pool_cached;
                    Some(DeviceMemory {
                        total: total as u64,
                        free: (free + cached) as u64,
                    })
                }
                Err(e) => {
                    tracing::warn!("cannot read the GPU's memory: {e}");
                    None
                }
            },
        }
    }
}

/// A cache of one of the backends.
#[derive(Clone)]
pub(crate) enum AnyCache {
    Candle(SequenceCache<CandleBackend>),
    #[cfg(feature = "mlx")]
    Mlx(SequenceCache<MlxBackend>),
    #[cfg(feature = "cuda")]
    Cuda(SequenceCache<CudaBackend>),
}

/// Runs `$body` with `$d` bound to the decoder, whatever its backend.
macro_rules! with_decoder {
    ($any:expr, $d:ident => $body:expr) => {
        match $any {
            AnyDecoder::Candle($d) => $body,
            #[cfg(feature = "mlx")]
            AnyDecoder::Mlx($d) => $body,
            #[cfg(feature = "cuda")]
            AnyDecoder::Cuda($d) => $body,
        }
    };
}
pub(crate) use with_decoder;

/// Runs `$body` with `$c` bound to the cache, whatever its backend.
macro_rules! with_cache {
    ($any:expr, $c:ident => $body:expr) => {
        match $any {
            AnyCache::Candle($c) => $body,
            #[cfg(feature = "mlx")]
            AnyCache::Mlx($c) => $body,
            #[cfg(feature = "cuda")]
            AnyCache::Cuda($c) => $body,
        }
    };
}
pub(crate) use with_cache;

/// Backend-specific cache access for the generic paths of [`Model`].
pub(crate) trait CacheOf: Backend + Sized {
    fn wrap(cache: SequenceCache<Self>) -> AnyCache;
    fn unwrap(cache: &mut AnyCache) -> Result<&mut SequenceCache<Self>>;
}

impl CacheOf for CandleBackend {
    fn wrap(cache: SequenceCache<Self>) -> AnyCache {
        AnyCache::Candle(cache)
    }
    fn unwrap(cache: &mut AnyCache) -> Result<&mut SequenceCache<Self>> {
        match cache {
            AnyCache::Candle(c) => Ok(c),
            #[cfg(any(feature = "mlx", feature = "cuda"))]
            _ => Err(other_backend()),
        }
    }
}

#[cfg(feature = "mlx")]
impl CacheOf for MlxBackend {
    fn wrap(cache: SequenceCache<Self>) -> AnyCache {
        AnyCache::Mlx(cache)
    }
    fn unwrap(cache: &mut AnyCache) -> Result<&mut SequenceCache<Self>> {
        match cache {
            AnyCache::Mlx(c) => Ok(c),
            _ => Err(other_backend()),
        }
    }
}

#[cfg(feature = "cuda")]
impl CacheOf for CudaBackend {
    fn wrap(cache: SequenceCache<Self>) -> AnyCache {
        AnyCache::Cuda(cache)
    }
    fn unwrap(cache: &mut AnyCache) -> Result<&mut SequenceCache<Self>> {
        match cache {
            AnyCache::Cuda(c) => Ok(c),
            #[allow(unreachable_patterns)]
            _ => Err(other_backend()),
        }
    }
}

#[cfg(any(feature = "mlx", feature = "cuda"))]
fn other_backend() -> EngineError {
    EngineError::Cache("cache belongs to a model on another backend".into())
}

pub(crate) fn wrap_cache<B: CacheOf>(cache: SequenceCache<B>) -> AnyCache {
    B::wrap(cache)
}
