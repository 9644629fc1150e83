//! Stand-ins for the shim when wick-mlx is built without the `runtime` feature: every
//! call fails, and [`crate::MlxError::NotLinked`] says why.
#![allow(missing_docs, clippy::missing_safety_doc, clippy::too_many_arguments)]
use super::{wm_array, wm_stream};
use std::os::raw::{c_char, c_int};

const NOT_LINKED: &std::ffi::CStr =
    c"wick-mlx was built without the MLX runtime (cargo feature `runtime`; see docs/mlx.md)";
const VERSION: &std::ffi::CStr = c"none";

pub unsafe fn wm_last_error() -> *const c_char {
    NOT_LINKED.as_ptr()
}
pub unsafe fn wm_version() -> *const c_char {
    VERSION.as_ptr()
}
pub unsafe fn wm_gpu_available(_out: *mut i32) -> c_int {
    -1
}
pub unsafe fn wm_new_stream(_device_type: i32, _out: *mut wm_stream) -> c_int {
    -1
}
pub unsafe fn wm_synchronize(_s: wm_stream) -> c_int {
    -1
}
pub unsafe fn wm_memory(_active: *mut usize, _peak: *mut usize, _cache: *mut usize) -> c_int {
    -1
}
pub unsafe fn wm_gpu_memory(_total: *mut usize, _free_bytes: *mut usize) -> c_int {
    -1
}
pub unsafe fn wm_clear_cache() -> c_int {
    -1
}
pub unsafe fn wm_array_free(_a: wm_array) {}
pub unsafe fn wm_array_clone(_a: wm_array, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_array_ndim(_a: wm_array, _out: *mut i32) -> c_int {
    -1
}
pub unsafe fn wm_array_shape(_a: wm_array, _shape: *mut i32, _cap: i32) -> c_int {
    -1
}
pub unsafe fn wm_array_dtype(_a: wm_array, _out: *mut i32) -> c_int {
    -1
}
pub unsafe fn wm_array_from_bytes(
    _data: *const u8,
    _nbytes: usize,
    _shape: *const i32,
    _ndim: i32,
    _dtype: i32,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_array_read(_a: wm_array, _offset: usize, _out: *mut u8, _nbytes: usize) -> c_int {
    -1
}
pub unsafe fn wm_eval(_arrays: *const wm_array, _n: usize) -> c_int {
    -1
}
pub unsafe fn wm_async_eval(_arrays: *const wm_array, _n: usize) -> c_int {
    -1
}
pub unsafe fn wm_reshape(
    _a: wm_array,
    _shape: *const i32,
    _ndim: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_transpose(
    _a: wm_array,
    _axes: *const i32,
    _n: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_slice(
    _a: wm_array,
    _start: *const i32,
    _stop: *const i32,
    _n: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_slice_update(
    _src: wm_array,
    _update: wm_array,
    _start: *const i32,
    _stop: *const i32,
    _n: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_concatenate(
    _arrays: *const wm_array,
    _n: usize,
    _axis: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_take(
    _a: wm_array,
    _indices: wm_array,
    _axis: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_astype(_a: wm_array, _dtype: i32, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_contiguous(_a: wm_array, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_zeros(
    _shape: *const i32,
    _ndim: i32,
    _dtype: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_add(_a: wm_array, _b: wm_array, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_multiply(_a: wm_array, _b: wm_array, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_scale(_a: wm_array, _k: f32, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_softcap(_a: wm_array, _cap: f32, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_matmul(_a: wm_array, _b: wm_array, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_argmax(_a: wm_array, _axis: i32, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_softmax(_a: wm_array, _axis: i32, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_where(
    _cond: wm_array,
    _a: wm_array,
    _b: wm_array,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_glu(
    _gate: wm_array,
    _up: wm_array,
    _act: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_activation(_x: wm_array, _act: i32, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_layer_norm(
    _x: wm_array,
    _weight: wm_array,
    _bias: wm_array,
    _eps: f32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_quantized_matmul(
    _x: wm_array,
    _w: wm_array,
    _scales: wm_array,
    _biases: wm_array,
    _group_size: i32,
    _bits: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_quantize(
    _w: wm_array,
    _group_size: i32,
    _bits: i32,
    _s: wm_stream,
    _wq: *mut wm_array,
    _scales: *mut wm_array,
    _biases: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_dequantize(
    _w: wm_array,
    _scales: wm_array,
    _biases: wm_array,
    _group_size: i32,
    _bits: i32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_rms_norm(
    _x: wm_array,
    _weight: wm_array,
    _eps: f32,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_rope(
    _x: wm_array,
    _dims: i32,
    _traditional: i32,
    _base: f32,
    _scale: f32,
    _offset: i32,
    _offsets: wm_array,
    _freqs: wm_array,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_sdpa(
    _q: wm_array,
    _k: wm_array,
    _v: wm_array,
    _scale: f32,
    _mask_mode: i32,
    _mask: wm_array,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_gemv(_x: wm_array, _w: wm_array, _s: wm_stream, _out: *mut wm_array) -> c_int {
    -1
}
pub unsafe fn wm_add_rms_norm(
    _x: wm_array,
    _r: wm_array,
    _w: wm_array,
    _eps: f32,
    _s: wm_stream,
    _sum: *mut wm_array,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_sigmoid_gate(
    _x: wm_array,
    _gate: wm_array,
    _s: wm_stream,
    _out: *mut wm_array,
) -> c_int {
    -1
}
pub unsafe fn wm_gated_delta(
    _qkv: wm_array,
    _z: wm_array,
    _b: wm_array,
    _a: wm_array,
    _conv: wm_array,
    _ssm: wm_array,
    _conv_w: wm_array,
    _neg_a: wm_array,
    _dt_bias: wm_array,
    _norm: wm_array,
    _dims: *const i32,
    _eps: f32,
    _chunked: i32,
    _s: wm_stream,
    _out: *mut wm_array,
    _conv_out: *mut wm_array,
    _ssm_out: *mut wm_array,
) -> c_int {
    -1
}
