//! Raw declarations of the C ABI in `shim/shim.h` (keep the two in step), or stand-ins
//! that fail when the crate is built without the `runtime` feature.
#![allow(missing_docs)]
#[cfg(feature = "runtime")]
use std::os::raw::{c_char, c_int};

#[repr(C)]
pub struct wm_array_s {
    _private: [u8; 0],
}
pub type wm_array = *mut wm_array_s;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct wm_stream {
    pub index: i32,
    pub device_type: i32,
    pub device_index: i32,
}

pub const WM_BOOL: i32 = 0;
pub const WM_UINT8: i32 = 1;
pub const WM_UINT32: i32 = 2;
pub const WM_INT32: i32 = 3;
pub const WM_FLOAT16: i32 = 4;
pub const WM_BFLOAT16: i32 = 5;
pub const WM_FLOAT32: i32 = 6;

#[cfg(not(feature = "runtime"))]
mod stub;
#[cfg(not(feature = "runtime"))]
pub use stub::*;

#[cfg(feature = "runtime")]
extern "C" {
    pub fn wm_last_error() -> *const c_char;
    pub fn wm_version() -> *const c_char;
    pub fn wm_gpu_available(out: *mut i32) -> c_int;
    pub fn wm_new_stream(device_type: i32, out: *mut wm_stream) -> c_int;
    pub fn wm_synchronize(s: wm_stream) -> c_int;
    pub fn wm_memory(active: *mut usize, peak: *mut usize, cache: *mut usize) -> c_int;
    pub fn wm_gpu_memory(total: *mut usize, free_bytes: *mut usize) -> c_int;
    pub fn wm_clear_cache() -> c_int;

    pub fn wm_array_free(a: wm_array);
    pub fn wm_array_clone(a: wm_array, out: *mut wm_array) -> c_int;
    pub fn wm_array_ndim(a: wm_array, out: *mut i32) -> c_int;
    pub fn wm_array_shape(a: wm_array, shape: *mut i32, cap: i32) -> c_int;
    pub fn wm_array_dtype(a: wm_array, out: *mut i32) -> c_int;
    pub fn wm_array_from_bytes(
        data: *const u8,
        nbytes: usize,
        shape: *const i32,
        ndim: i32,
        dtype: i32,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_array_read(a: wm_array, offset: usize, out: *mut u8, nbytes: usize) -> c_int;

    pub fn wm_eval(arrays: *const wm_array, n: usize) -> c_int;
    pub fn wm_async_eval(arrays: *const wm_array, n: usize) -> c_int;

    pub fn wm_reshape(
        a: wm_array,
        shape: *const i32,
        ndim: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_transpose(
        a: wm_array,
        axes: *const i32,
        n: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_slice(
        a: wm_array,
        start: *const i32,
        stop: *const i32,
        n: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_slice_update(
        src: wm_array,
        update: wm_array,
        start: *const i32,
        stop: *const i32,
        n: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_concatenate(
        arrays: *const wm_array,
        n: usize,
        axis: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_take(
        a: wm_array,
        indices: wm_array,
        axis: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_astype(a: wm_array, dtype: i32, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_contiguous(a: wm_array, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_zeros(
        shape: *const i32,
        ndim: i32,
        dtype: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;

    pub fn wm_add(a: wm_array, b: wm_array, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_multiply(a: wm_array, b: wm_array, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_scale(a: wm_array, k: f32, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_softcap(a: wm_array, cap: f32, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_matmul(a: wm_array, b: wm_array, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_argmax(a: wm_array, axis: i32, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_softmax(a: wm_array, axis: i32, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_where(
        cond: wm_array,
        a: wm_array,
        b: wm_array,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_glu(
        gate: wm_array,
        up: wm_array,
        act: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_activation(x: wm_array, act: i32, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_sigmoid_gate(x: wm_array, gate: wm_array, s: wm_stream, out: *mut wm_array) -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub fn wm_gated_delta(
        qkv: wm_array,
        z: wm_array,
        b: wm_array,
        a: wm_array,
        conv: wm_array,
        ssm: wm_array,
        conv_w: wm_array,
        neg_a: wm_array,
        dt_bias: wm_array,
        norm: wm_array,
        dims: *const i32,
        eps: f32,
        chunked: i32,
        s: wm_stream,
        out: *mut wm_array,
        conv_out: *mut wm_array,
        ssm_out: *mut wm_array,
    ) -> c_int;

    pub fn wm_gemv(x: wm_array, w: wm_array, s: wm_stream, out: *mut wm_array) -> c_int;
    pub fn wm_add_rms_norm(
        x: wm_array,
        r: wm_array,
        w: wm_array,
        eps: f32,
        s: wm_stream,
        sum: *mut wm_array,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_quantized_matmul(
        x: wm_array,
        w: wm_array,
        scales: wm_array,
        biases: wm_array,
        group_size: i32,
        bits: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_quantize(
        w: wm_array,
        group_size: i32,
        bits: i32,
        s: wm_stream,
        wq: *mut wm_array,
        scales: *mut wm_array,
        biases: *mut wm_array,
    ) -> c_int;
    pub fn wm_dequantize(
        w: wm_array,
        scales: wm_array,
        biases: wm_array,
        group_size: i32,
        bits: i32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;

    pub fn wm_rms_norm(
        x: wm_array,
        weight: wm_array,
        eps: f32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_layer_norm(
        x: wm_array,
        weight: wm_array,
        bias: wm_array,
        eps: f32,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_rope(
        x: wm_array,
        dims: i32,
        traditional: i32,
        base: f32,
        scale: f32,
        offset: i32,
        offsets: wm_array,
        freqs: wm_array,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
    pub fn wm_sdpa(
        q: wm_array,
        k: wm_array,
        v: wm_array,
        scale: f32,
        mask_mode: i32,
        mask: wm_array,
        s: wm_stream,
        out: *mut wm_array,
    ) -> c_int;
}
