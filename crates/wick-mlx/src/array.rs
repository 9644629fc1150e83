//! [`Array`]: an owned handle to an MLX array (a node of MLX's lazy graph), and [`Dtype`].
use std::ffi::CStr;

use crate::error::{MlxError, Result};
use crate::ffi;

/// Element type of an array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `bool`
    Bool,
    /// `uint8`
    U8,
    /// `uint32` (packed quantized weights, token ids)
    U32,
    /// `int32` (positions, offsets)
    I32,
    /// IEEE half
    F16,
    /// bfloat16
    BF16,
    /// `float32`
    F32,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 => 1,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
        }
    }

    pub(crate) fn code(self) -> i32 {
        match self {
            Dtype::Bool => ffi::WM_BOOL,
            Dtype::U8 => ffi::WM_UINT8,
            Dtype::U32 => ffi::WM_UINT32,
            Dtype::I32 => ffi::WM_INT32,
            Dtype::F16 => ffi::WM_FLOAT16,
            Dtype::BF16 => ffi::WM_BFLOAT16,
            Dtype::F32 => ffi::WM_FLOAT32,
        }
    }

    fn from_code(code: i32) -> Option<Dtype> {
        Some(match code {
            ffi::WM_BOOL => Dtype::Bool,
            ffi::WM_UINT8 => Dtype::U8,
            ffi::WM_UINT32 => Dtype::U32,
            ffi::WM_INT32 => Dtype::I32,
            ffi::WM_FLOAT16 => Dtype::F16,
            ffi::WM_BFLOAT16 => Dtype::BF16,
            ffi::WM_FLOAT32 => Dtype::F32,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8",
            Dtype::U32 => "uint32",
            Dtype::I32 => "int32",
            Dtype::F16 => "float16",
            Dtype::BF16 => "bfloat16",
            Dtype::F32 => "float32",
        })
    }
}

/// Rust element types that map to an MLX dtype one to one.
pub trait Element: Copy + Default + 'static {
    /// The matching dtype.
    const DTYPE: Dtype;
}

impl Element for u8 {
    const DTYPE: Dtype = Dtype::U8;
}
impl Element for u32 {
    const DTYPE: Dtype = Dtype::U32;
}
impl Element for i32 {
    const DTYPE: Dtype = Dtype::I32;
}
impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
}

/// The message of the last failed shim call on this thread, as an error for `op`.
pub(crate) fn last_error(op: &'static str) -> MlxError {
    if !cfg!(feature = "runtime") {
        return MlxError::NotLinked;
    }
    // SAFETY: wm_last_error returns a pointer to a thread-local NUL-terminated string that
    // lives until the next failing call on this thread; it is copied at once.
    let message = unsafe { CStr::from_ptr(ffi::wm_last_error()) }
        .to_string_lossy()
        .into_owned();
    MlxError::Op { op, message }
}

/// Turns a shim status into a `Result`.
pub(crate) fn check(status: i32, op: &'static str) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(last_error(op))
    }
}

/// Runs a shim call that writes one array handle.
pub(crate) fn make(op: &'static str, f: impl FnOnce(*mut ffi::wm_array) -> i32) -> Result<Array> {
    let mut out: ffi::wm_array = std::ptr::null_mut();
    check(f(&mut out), op)?;
    if out.is_null() {
        return Err(MlxError::Op {
            op,
            message: "returned no array".into(),
        });
    }
    Ok(Array { raw: out })
}

/// An MLX array. Cloning shares the node (MLX arrays are immutable values); dropping
/// releases this handle. Operations are lazy: nothing is computed until [`crate::eval`],
/// [`crate::async_eval`] or a read such as [`Array::to_vec`].
pub struct Array {
    pub(crate) raw: ffi::wm_array,
}

// SAFETY: the shim serializes every entry into MLX (handle copies and frees included)
// behind one process-wide lock, and MLX arrays are immutable once built, so a handle may
// move to and be shared with other threads.
unsafe impl Send for Array {}
// SAFETY: see `Send`: every access goes through the locked shim.
unsafe impl Sync for Array {}

impl Drop for Array {
    fn drop(&mut self) {
        // SAFETY: `raw` came from the shim and is freed exactly once, here.
        unsafe { ffi::wm_array_free(self.raw) }
    }
}

impl Clone for Array {
    fn clone(&self) -> Self {
        let mut out: ffi::wm_array = std::ptr::null_mut();
        // SAFETY: `raw` is a live handle. Copying a handle only bumps a reference count;
        // it fails only on allocation failure, which aborts like any Rust allocation.
        let status = unsafe { ffi::wm_array_clone(self.raw, &mut out) };
        if status != 0 || out.is_null() {
            std::alloc::handle_alloc_error(std::alloc::Layout::new::<usize>());
        }
        Array { raw: out }
    }
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Array")
            .field("shape", &self.shape())
            .field("dtype", &self.dtype())
            .finish()
    }
}

impl Array {
    /// A new array holding a copy of `bytes` (little-endian elements of `dtype`).
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        let count: i64 = shape.iter().map(|&d| d as i64).product();
        if shape.iter().any(|&d| d < 0) || count as usize * dtype.size() != bytes.len() {
            return Err(MlxError::InvalidArgument {
                op: "from_bytes",
                reason: format!(
                    "{} bytes do not hold a {shape:?} array of {dtype}",
                    bytes.len()
                ),
            });
        }
        // SAFETY: pointers are valid for the given lengths; the shim copies the bytes.
        make("from_bytes", |out| unsafe {
            ffi::wm_array_from_bytes(
                bytes.as_ptr(),
                bytes.len(),
                shape.as_ptr(),
                shape.len() as i32,
                dtype.code(),
                out,
            )
        })
    }

    /// A new array holding a copy of `data`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        // SAFETY: Element types are plain integers/floats without padding.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        Array::from_bytes(bytes, shape, T::DTYPE)
    }

    /// Dimensions.
    pub fn shape(&self) -> Vec<i32> {
        let mut ndim = 0i32;
        // SAFETY: live handle, valid out pointer.
        if unsafe { ffi::wm_array_ndim(self.raw, &mut ndim) } != 0 {
            return Vec::new();
        }
        let mut dims = vec![0i32; ndim.max(0) as usize];
        // SAFETY: `dims` has room for `ndim` values.
        if unsafe { ffi::wm_array_shape(self.raw, dims.as_mut_ptr(), ndim) } != 0 {
            return Vec::new();
        }
        dims
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape().len()
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        self.shape().iter().map(|&d| d as usize).product()
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        let mut code = -1;
        // SAFETY: live handle, valid out pointer.
        unsafe { ffi::wm_array_dtype(self.raw, &mut code) };
        Dtype::from_code(code).unwrap_or(Dtype::F32)
    }

    /// Bytes the elements occupy.
    pub fn nbytes(&self) -> usize {
        self.size() * self.dtype().size()
    }

    /// Evaluates the array and copies its elements out, row-major. `T` must match the
    /// array's dtype (convert with [`crate::Stream::astype`] first).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.read_range(0, self.size())
    }

    /// Evaluates the array and copies elements `start..start + len` (row-major) out:
    /// rows of a result without a copy of the whole.
    pub fn read_range<T: Element>(&self, start: usize, len: usize) -> Result<Vec<T>> {
        if self.dtype() != T::DTYPE {
            return Err(MlxError::InvalidArgument {
                op: "read_range",
                reason: format!("array is {}, asked for {}", self.dtype(), T::DTYPE),
            });
        }
        let size = std::mem::size_of::<T>();
        let mut out: Vec<T> = Vec::with_capacity(len);
        // SAFETY: `out` has room for `len` elements (`len · size` bytes); the shim checks
        // the range against the array and either fills all of them or fails, and only
        // then is the length set. Element types are plain numbers: any bytes are valid.
        unsafe {
            check(
                ffi::wm_array_read(
                    self.raw,
                    start * size,
                    out.as_mut_ptr().cast::<u8>(),
                    len * size,
                ),
                "read",
            )?;
            out.set_len(len);
        }
        Ok(out)
    }

    /// Evaluates the array and copies its raw bytes out, row-major.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.nbytes()];
        // SAFETY: `out` is exactly as long as the array's bytes; the shim checks it.
        check(
            unsafe { ffi::wm_array_read(self.raw, 0, out.as_mut_ptr(), out.len()) },
            "read",
        )?;
        Ok(out)
    }
}

/// Evaluates `arrays` and waits for them.
pub fn eval(arrays: &[&Array]) -> Result<()> {
    let raw: Vec<ffi::wm_array> = arrays.iter().map(|a| a.raw).collect();
    // SAFETY: every handle is live for the duration of the call.
    check(unsafe { ffi::wm_eval(raw.as_ptr(), raw.len()) }, "eval")
}

/// Starts evaluating `arrays` and returns at once; a later read or [`eval`] waits.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    let raw: Vec<ffi::wm_array> = arrays.iter().map(|a| a.raw).collect();
    // SAFETY: every handle is live for the duration of the call.
    check(
        unsafe { ffi::wm_async_eval(raw.as_ptr(), raw.len()) },
        "async_eval",
    )
}
