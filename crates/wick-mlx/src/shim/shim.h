// wick-mlx: a C ABI over the few MLX C++ operations wick needs.
//
// Every function returns 0 on success and -1 when MLX threw; the message is then
// available from wm_last_error() on the same thread. Arrays are opaque heap handles that
// the caller frees with wm_array_free. Every call holds one process-wide lock, so MLX is
// only ever entered by one thread at a time.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wm_array_s* wm_array;

// A stream: index and device (0 = cpu, 1 = gpu).
typedef struct {
  int32_t index;
  int32_t device_type;
  int32_t device_index;
} wm_stream;

// Element types (wick-mlx's own numbering, mapped in the shim).
enum {
  WM_BOOL = 0,
  WM_UINT8 = 1,
  WM_UINT32 = 2,
  WM_INT32 = 3,
  WM_FLOAT16 = 4,
  WM_BFLOAT16 = 5,
  WM_FLOAT32 = 6,
};

const char* wm_last_error(void);
const char* wm_version(void);

// Devices and streams.
int wm_gpu_available(int32_t* out);
int wm_new_stream(int32_t device_type, wm_stream* out);
int wm_synchronize(wm_stream s);

// Memory.
int wm_memory(size_t* active, size_t* peak, size_t* cache);
// The GPU's total memory and what is free now (CUDA: as NVML or cudaMemGetInfo report it;
// Metal: the recommended working set less MLX's live arrays); zeros without a GPU.
int wm_gpu_memory(size_t* total, size_t* free_bytes);
int wm_clear_cache(void);

// Array handles.
void wm_array_free(wm_array a);
int wm_array_clone(wm_array a, wm_array* out);
int wm_array_ndim(wm_array a, int32_t* out);
int wm_array_shape(wm_array a, int32_t* shape, int32_t cap);
int wm_array_dtype(wm_array a, int32_t* out);
// Copies `nbytes` of host data into a new array (the bytes are copied before return).
int wm_array_from_bytes(const void* data, size_t nbytes, const int32_t* shape,
                        int32_t ndim, int32_t dtype, wm_array* out);
// Evaluates `a` and copies `nbytes` of its bytes (row-major, as its dtype) from byte
// `offset` on to `out`.
int wm_array_read(wm_array a, size_t offset, void* out, size_t nbytes);

// Evaluation.
int wm_eval(const wm_array* arrays, size_t n);
int wm_async_eval(const wm_array* arrays, size_t n);

// Shape ops.
int wm_reshape(wm_array a, const int32_t* shape, int32_t ndim, wm_stream s, wm_array* out);
int wm_transpose(wm_array a, const int32_t* axes, int32_t n, wm_stream s, wm_array* out);
int wm_slice(wm_array a, const int32_t* start, const int32_t* stop, int32_t n, wm_stream s,
             wm_array* out);
int wm_slice_update(wm_array src, wm_array update, const int32_t* start, const int32_t* stop,
                    int32_t n, wm_stream s, wm_array* out);
int wm_concatenate(const wm_array* arrays, size_t n, int32_t axis, wm_stream s, wm_array* out);
int wm_take(wm_array a, wm_array indices, int32_t axis, wm_stream s, wm_array* out);
int wm_astype(wm_array a, int32_t dtype, wm_stream s, wm_array* out);
int wm_contiguous(wm_array a, wm_stream s, wm_array* out);
int wm_zeros(const int32_t* shape, int32_t ndim, int32_t dtype, wm_stream s, wm_array* out);

// Arithmetic.
int wm_add(wm_array a, wm_array b, wm_stream s, wm_array* out);
int wm_multiply(wm_array a, wm_array b, wm_stream s, wm_array* out);
int wm_scale(wm_array a, float k, wm_stream s, wm_array* out);
int wm_softcap(wm_array a, float cap, wm_stream s, wm_array* out);
int wm_matmul(wm_array a, wm_array b, wm_stream s, wm_array* out);
int wm_argmax(wm_array a, int32_t axis, wm_stream s, wm_array* out);
int wm_softmax(wm_array a, int32_t axis, wm_stream s, wm_array* out);
int wm_where(wm_array cond, wm_array a, wm_array b, wm_stream s, wm_array* out);
// act(gate) * up, fused by mx::compile. act: 0 = silu, 1 = gelu (tanh approximation).
int wm_glu(wm_array gate, wm_array up, int32_t act, wm_stream s, wm_array* out);
// act(x) elementwise (act as in wm_glu), compiled into one kernel.
int wm_activation(wm_array x, int32_t act, wm_stream s, wm_array* out);

// x * sigmoid(gate), the sigmoid in float32 (an attention output gate).
int wm_sigmoid_gate(wm_array x, wm_array gate, wm_stream s, wm_array* out);
// The gated DeltaNet mixer of `B` sequences of `m` rows each (Qwen 3.5's linear attention):
// qkv [B, m, conv_dim], z [B, m, vh*vd], b and a [B, m, vh] in the compute dtype; the states
// conv [B, kernel-1, conv_dim] and ssm [B, vh, kd, vd] in float32; conv_w [conv_dim, kernel],
// neg_a, dt_bias [vh] and norm [vd] in float32; dims = {kh, vh, kd, vd}. `chunked` selects the
// chunked form of the delta rule (64 tokens a chunk), else token by token. Returns the normed,
// gated output [B, m, vh*vd] in qkv's dtype and the two new states.
int wm_gated_delta(wm_array qkv, wm_array z, wm_array b, wm_array a, wm_array conv,
                   wm_array ssm, wm_array conv_w, wm_array neg_a, wm_array dt_bias,
                   wm_array norm, const int32_t* dims, float eps, int32_t chunked, wm_stream s,
                   wm_array* out, wm_array* conv_out, wm_array* ssm_out);

// Custom CUDA kernels (GPU streams only; elsewhere they fail with a message).
// y = x · wᵀ for x [B ≤ 8, K], w [N, K] in bf16/f16.
int wm_gemv(wm_array x, wm_array w, wm_stream s, wm_array* out);
// sum = x + r; out = rms_norm(sum) * w, for [R, H] rows of bf16/f16.
int wm_add_rms_norm(wm_array x, wm_array r, wm_array w, float eps, wm_stream s, wm_array* sum,
                    wm_array* out);

// Quantization (MLX affine mode).
int wm_quantized_matmul(wm_array x, wm_array w, wm_array scales, wm_array biases,
                        int32_t group_size, int32_t bits, wm_stream s, wm_array* out);
int wm_quantize(wm_array w, int32_t group_size, int32_t bits, wm_stream s, wm_array* wq,
                wm_array* scales, wm_array* biases);
int wm_dequantize(wm_array w, wm_array scales, wm_array biases, int32_t group_size,
                  int32_t bits, wm_stream s, wm_array* out);

// mlx::core::fast.
int wm_rms_norm(wm_array x, wm_array weight, float eps, wm_stream s, wm_array* out);
// weight and bias may be null (then 1 and 0).
int wm_layer_norm(wm_array x, wm_array weight, wm_array bias, float eps, wm_stream s,
                  wm_array* out);
// offset: when `offsets` is null, the integer `offset`; else a per-batch int32 array.
// freqs may be null (then `base` is used).
int wm_rope(wm_array x, int32_t dims, int32_t traditional, float base, float scale,
            int32_t offset, wm_array offsets, wm_array freqs, wm_stream s, wm_array* out);
// mask_mode: 0 = none, 1 = causal, 2 = the boolean/additive `mask` array.
int wm_sdpa(wm_array q, wm_array k, wm_array v, float scale, int32_t mask_mode, wm_array mask,
            wm_stream s, wm_array* out);

#ifdef __cplusplus
}
#endif
