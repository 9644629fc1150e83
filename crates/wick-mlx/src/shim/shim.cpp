// wick-mlx's C ABI over the MLX C++ API (see shim.h for the contract).
#include "shim.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "mlx/mlx.h"

namespace mx = mlx::core;

struct wm_array_s {
  mx::array a;
};

namespace {

// One lock for every entry into MLX (see shim.h).
std::recursive_mutex& lock() {
  static std::recursive_mutex m;
  return m;
}

thread_local std::string last_error;

wm_array wrap(mx::array a) { return new wm_array_s{std::move(a)}; }

mx::Dtype to_dtype(int32_t d) {
  switch (d) {
    case WM_BOOL:
      return mx::bool_;
    case WM_UINT8:
      return mx::uint8;
    case WM_UINT32:
      return mx::uint32;
    case WM_INT32:
      return mx::int32;
    case WM_FLOAT16:
      return mx::float16;
    case WM_BFLOAT16:
      return mx::bfloat16;
    case WM_FLOAT32:
      return mx::float32;
    default:
      throw std::invalid_argument("wick-mlx: unknown dtype code " + std::to_string(d));
  }
}

int32_t from_dtype(mx::Dtype d) {
  if (d == mx::bool_) return WM_BOOL;
  if (d == mx::uint8) return WM_UINT8;
  if (d == mx::uint32) return WM_UINT32;
  if (d == mx::int32) return WM_INT32;
  if (d == mx::float16) return WM_FLOAT16;
  if (d == mx::bfloat16) return WM_BFLOAT16;
  if (d == mx::float32) return WM_FLOAT32;
  return -1;
}

mx::Stream stream(wm_stream s) {
  return mx::Stream(s.index, mx::Device(s.device_type == 1 ? mx::Device::gpu : mx::Device::cpu,
                                        s.device_index));
}

mx::Shape shape(const int32_t* dims, int32_t n) {
  mx::Shape out;
  for (int32_t i = 0; i < n; ++i) out.push_back(dims[i]);
  return out;
}

std::vector<mx::array> arrays(const wm_array* a, size_t n) {
  std::vector<mx::array> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(a[i]->a);
  return out;
}

// Runs `f` under the lock, turning exceptions into -1 and a message.
template <typename F>
int guarded(F&& f) {
  std::lock_guard<std::recursive_mutex> g(lock());
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return -1;
}

std::vector<mx::array> silu_mul(const std::vector<mx::array>& in) {
  const auto& g = in[0];
  return {mx::multiply(mx::multiply(g, mx::sigmoid(g)), in[1])};
}

std::vector<mx::array> gelu_tanh_mul(const std::vector<mx::array>& in) {
  const auto& x = in[0];
  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  auto c = mx::array(std::sqrt(2.0f / static_cast<float>(M_PI)), x.dtype());
  auto inner = mx::multiply(c, mx::add(x, mx::multiply(mx::array(0.044715f, x.dtype()),
                                                       mx::multiply(x, mx::multiply(x, x)))));
  auto g = mx::multiply(mx::multiply(mx::array(0.5f, x.dtype()), x),
                        mx::add(mx::array(1.0f, x.dtype()), mx::tanh(inner)));
  return {mx::multiply(g, in[1])};
}

// Custom CUDA kernels (JIT-compiled by MLX through NVRTC on first use; GPU only).
// Bodies only: MLX generates the signature from the input/output names and turns the
// template arguments into constants.

// y[b, n] = sum_k x[b, k] * w[n, k] for a few rows b: one warp per output row n,
// 16-byte loads of w, four in flight per thread, f32 accumulation.
constexpr const char* gemv_source = R"(
  const int lane = threadIdx.x & 31;
  const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= N) return;
  constexpr int VEC = K / 8;
  const uint4* wr = reinterpret_cast<const uint4*>(w) + row * VEC;
  const uint4* xr = reinterpret_cast<const uint4*>(x);
  float acc[BATCH];
#pragma unroll
  for (int b = 0; b < BATCH; ++b) acc[b] = 0.f;
#pragma unroll 4
  for (int i = lane; i < VEC; i += 32) {
    uint4 wv = __ldg(wr + i);
    const T* wp = reinterpret_cast<const T*>(&wv);
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      uint4 xv = xr[b * VEC + i];
      const T* xp = reinterpret_cast<const T*>(&xv);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[b] += static_cast<float>(wp[j]) * static_cast<float>(xp[j]);
      }
    }
  }
#pragma unroll
  for (int b = 0; b < BATCH; ++b) {
    float v = acc[b];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) y[(long)b * N + row] = static_cast<T>(v);
  }
)";

// s = x + r (rounded to T) and out = w * T(s * rsqrt(mean(s^2) + eps)), one block of
// 256 threads per row (MLX's add and rms_norm numerics, one pass instead of two).
constexpr const char* add_rms_norm_source = R"(
  constexpr int VEC = H / 8;
  constexpr int PER = (VEC + 255) / 256;
  const float eps = __int_as_float(EPS_BITS);
  const long row = blockIdx.x;
  const uint4* xr = reinterpret_cast<const uint4*>(x) + row * VEC;
  const uint4* rr = reinterpret_cast<const uint4*>(r) + row * VEC;
  const uint4* wr = reinterpret_cast<const uint4*>(w);
  uint4* sr = reinterpret_cast<uint4*>(sum) + row * VEC;
  uint4* orow = reinterpret_cast<uint4*>(out) + row * VEC;
  uint4 sv[PER];
  float ss = 0.f;
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int i = threadIdx.x + p * 256;
    if (i < VEC) {
      uint4 a = xr[i];
      uint4 b = rr[i];
      const T* ap = reinterpret_cast<const T*>(&a);
      const T* bp = reinterpret_cast<const T*>(&b);
      T* sp = reinterpret_cast<T*>(&sv[p]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        T v = static_cast<T>(static_cast<float>(ap[j]) + static_cast<float>(bp[j]));
        sp[j] = v;
        float f = static_cast<float>(v);
        ss += f * f;
      }
      sr[i] = sv[p];
    }
  }
  __shared__ float part[8];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) total += part[k];
  const float norm = rsqrtf(total / H + eps);
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int i = threadIdx.x + p * 256;
    if (i < VEC) {
      uint4 wv = wr[i];
      uint4 o;
      const T* wp = reinterpret_cast<const T*>(&wv);
      const T* sp = reinterpret_cast<const T*>(&sv[p]);
      T* op = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        T y = static_cast<T>(static_cast<float>(sp[j]) * norm);
        op[j] = static_cast<T>(static_cast<float>(wp[j]) * static_cast<float>(y));
      }
      orow[i] = o;
    }
  }
)";

mx::fast::CustomKernelFunction& gemv_kernel() {
  static auto k = mx::fast::cuda_kernel("wick_gemv", {"x", "w"}, {"y"}, gemv_source, "", true, 0);
  return k;
}

mx::fast::CustomKernelFunction& add_rms_norm_kernel() {
  static auto k = mx::fast::cuda_kernel("wick_add_rms_norm", {"x", "r", "w"}, {"sum", "out"},
                                        add_rms_norm_source, "", true, 0);
  return k;
}

}  // namespace

extern "C" {

const char* wm_last_error(void) { return last_error.c_str(); }

const char* wm_version(void) { return mx::version(); }

int wm_gpu_available(int32_t* out) {
  return guarded([&] { *out = mx::is_available(mx::Device::gpu) ? 1 : 0; });
}

int wm_new_stream(int32_t device_type, wm_stream* out) {
  return guarded([&] {
    auto d = mx::Device(device_type == 1 ? mx::Device::gpu : mx::Device::cpu, 0);
    auto s = mx::new_thread_unsafe_stream(d);
    out->index = s.index;
    out->device_type = s.device.type == mx::Device::gpu ? 1 : 0;
    out->device_index = s.device.index;
  });
}

int wm_synchronize(wm_stream s) { return guarded([&] { mx::synchronize(stream(s)); }); }

int wm_memory(size_t* active, size_t* peak, size_t* cache) {
  return guarded([&] {
    *active = mx::get_active_memory();
    *peak = mx::get_peak_memory();
    *cache = mx::get_cache_memory();
  });
}

int wm_gpu_memory(size_t* total, size_t* free_bytes) {
  return guarded([&] {
    *total = 0;
    *free_bytes = 0;
    if (!mx::is_available(mx::Device::gpu)) {
      return;
    }
    const auto& info = mx::gpu::device_info(0);
    auto number = [&](const char* key) -> size_t {
      auto it = info.find(key);
      if (it == info.end()) {
        return 0;
      }
      const size_t* v = std::get_if<size_t>(&it->second);
      return v ? *v : 0;
    };
    *total = number("total_memory");
    if (*total == 0) {
      *total = number("memory_size");
    }
    *free_bytes = number("free_memory");
    if (*free_bytes == 0) {
      // Metal reports no free memory; what it recommends for one process, less what
      // MLX holds, is what is left to use.
      size_t working_set = number("max_recommended_working_set_size");
      size_t active = mx::get_active_memory();
      *free_bytes = working_set > active ? working_set - active : 0;
    }
  });
}

int wm_clear_cache(void) { return guarded([&] { mx::clear_cache(); }); }

void wm_array_free(wm_array a) {
  std::lock_guard<std::recursive_mutex> g(lock());
  delete a;
}

int wm_array_clone(wm_array a, wm_array* out) { return guarded([&] { *out = wrap(a->a); }); }

int wm_array_ndim(wm_array a, int32_t* out) {
  return guarded([&] { *out = static_cast<int32_t>(a->a.ndim()); });
}

int wm_array_shape(wm_array a, int32_t* dims, int32_t cap) {
  return guarded([&] {
    const auto& s = a->a.shape();
    if (static_cast<int32_t>(s.size()) > cap) throw std::invalid_argument("shape buffer too small");
    for (size_t i = 0; i < s.size(); ++i) dims[i] = s[i];
  });
}

int wm_array_dtype(wm_array a, int32_t* out) {
  return guarded([&] { *out = from_dtype(a->a.dtype()); });
}

int wm_array_from_bytes(const void* data, size_t nbytes, const int32_t* dims, int32_t ndim,
                        int32_t dtype, wm_array* out) {
  return guarded([&] {
    auto dt = to_dtype(dtype);
    auto sh = shape(dims, ndim);
    size_t count = 1;
    for (auto d : sh) count *= static_cast<size_t>(d);
    if (count * dt.size() != nbytes) {
      throw std::invalid_argument("wm_array_from_bytes: " + std::to_string(nbytes) +
                                  " bytes do not fill the shape");
    }
    // MLX takes the buffer without a copy where it can (CPU) and copies it otherwise;
    // either way it frees it through the deleter when done.
    void* copy = std::malloc(nbytes > 0 ? nbytes : 1);
    if (copy == nullptr) throw std::bad_alloc();
    if (nbytes > 0) std::memcpy(copy, data, nbytes);
    *out = wrap(mx::array(copy, std::move(sh), dt, [](void* p) { std::free(p); }));
  });
}

int wm_array_read(wm_array a, size_t offset, void* out, size_t nbytes) {
  return guarded([&] {
    // Wait for the array itself (no new graph node: a read of ids that were queued with
    // async_eval must not also wait for work queued after them).
    mx::array arr = a->a;
    arr.eval();
    if (!arr.flags().row_contiguous) {
      arr = mx::contiguous(arr);
      arr.eval();
    }
    if (offset > arr.nbytes() || nbytes > arr.nbytes() - offset) {
      throw std::invalid_argument("wm_array_read: array holds " + std::to_string(arr.nbytes()) +
                                  " bytes, asked for " + std::to_string(nbytes) + " from " +
                                  std::to_string(offset));
    }
    std::memcpy(out, arr.data<char>() + offset, nbytes);
  });
}

int wm_eval(const wm_array* a, size_t n) { return guarded([&] { mx::eval(arrays(a, n)); }); }

int wm_async_eval(const wm_array* a, size_t n) {
  return guarded([&] { mx::async_eval(arrays(a, n)); });
}

int wm_reshape(wm_array a, const int32_t* dims, int32_t ndim, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::reshape(a->a, shape(dims, ndim), stream(s))); });
}

int wm_transpose(wm_array a, const int32_t* axes, int32_t n, wm_stream s, wm_array* out) {
  return guarded([&] {
    std::vector<int> ax(axes, axes + n);
    *out = wrap(mx::transpose(a->a, ax, stream(s)));
  });
}

int wm_slice(wm_array a, const int32_t* start, const int32_t* stop, int32_t n, wm_stream s,
             wm_array* out) {
  return guarded(
      [&] { *out = wrap(mx::slice(a->a, shape(start, n), shape(stop, n), stream(s))); });
}

int wm_slice_update(wm_array src, wm_array update, const int32_t* start, const int32_t* stop,
                    int32_t n, wm_stream s, wm_array* out) {
  return guarded([&] {
    *out = wrap(
        mx::slice_update(src->a, update->a, shape(start, n), shape(stop, n), stream(s)));
  });
}

int wm_concatenate(const wm_array* a, size_t n, int32_t axis, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::concatenate(arrays(a, n), axis, stream(s))); });
}

int wm_take(wm_array a, wm_array indices, int32_t axis, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::take(a->a, indices->a, axis, stream(s))); });
}

int wm_astype(wm_array a, int32_t dtype, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::astype(a->a, to_dtype(dtype), stream(s))); });
}

int wm_contiguous(wm_array a, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::contiguous(a->a, false, stream(s))); });
}

int wm_zeros(const int32_t* dims, int32_t ndim, int32_t dtype, wm_stream s, wm_array* out) {
  return guarded(
      [&] { *out = wrap(mx::zeros(shape(dims, ndim), to_dtype(dtype), stream(s))); });
}

int wm_add(wm_array a, wm_array b, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::add(a->a, b->a, stream(s))); });
}

int wm_multiply(wm_array a, wm_array b, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::multiply(a->a, b->a, stream(s))); });
}

int wm_scale(wm_array a, float k, wm_stream s, wm_array* out) {
  return guarded([&] {
    *out = wrap(mx::multiply(a->a, mx::array(k, a->a.dtype()), stream(s)));
  });
}

int wm_softcap(wm_array a, float cap, wm_stream s, wm_array* out) {
  return guarded([&] {
    auto st = stream(s);
    auto dt = a->a.dtype();
    auto t = mx::tanh(mx::multiply(a->a, mx::array(1.0f / cap, dt), st), st);
    *out = wrap(mx::multiply(t, mx::array(cap, dt), st));
  });
}

int wm_matmul(wm_array a, wm_array b, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::matmul(a->a, b->a, stream(s))); });
}

int wm_argmax(wm_array a, int32_t axis, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::argmax(a->a, axis, false, stream(s))); });
}

int wm_softmax(wm_array a, int32_t axis, wm_stream s, wm_array* out) {
  return guarded(
      [&] { *out = wrap(mx::softmax(a->a, std::vector<int>{axis}, true, stream(s))); });
}

int wm_where(wm_array cond, wm_array a, wm_array b, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::where(cond->a, a->a, b->a, stream(s))); });
}

int wm_glu(wm_array gate, wm_array up, int32_t act, wm_stream s, wm_array* out) {
  return guarded([&] {
    static auto silu = mx::compile(silu_mul, /* shapeless = */ true);
    static auto gelu = mx::compile(gelu_tanh_mul, /* shapeless = */ true);
    // Compiled functions trace with the thread's default stream: make it ours.
    mx::set_default_stream(stream(s));
    auto& f = act == 0 ? silu : gelu;
    *out = wrap(f({gate->a, up->a})[0]);
  });
}

int wm_gemv(wm_array x, wm_array w, wm_stream s, wm_array* out) {
  return guarded([&] {
    const auto& xa = x->a;
    const auto& wa = w->a;
    if (xa.ndim() != 2 || wa.ndim() != 2 || xa.shape(1) != wa.shape(1)) {
      throw std::invalid_argument("wm_gemv: x [B, K] and w [N, K] expected");
    }
    int b = xa.shape(0), k = xa.shape(1), n = wa.shape(0);
    if (b < 1 || b > 8 || k % 8 != 0 || xa.dtype() != wa.dtype() ||
        !(xa.dtype() == mx::bfloat16 || xa.dtype() == mx::float16)) {
      throw std::invalid_argument("wm_gemv: 1..8 rows of bf16/f16, K a multiple of 8");
    }
    constexpr int warps = 4;
    auto r = gemv_kernel()({xa, wa}, {{b, n}}, {xa.dtype()}, {n * 32, 1, 1}, {32 * warps, 1, 1},
                           {{"T", xa.dtype()}, {"BATCH", b}, {"K", k}, {"N", n}}, std::nullopt,
                           false, stream(s));
    *out = wrap(r[0]);
  });
}

int wm_add_rms_norm(wm_array x, wm_array r, wm_array w, float eps, wm_stream s, wm_array* sum,
                    wm_array* out) {
  return guarded([&] {
    const auto& xa = x->a;
    if (xa.ndim() != 2 || r->a.shape() != xa.shape() || w->a.ndim() != 1 ||
        w->a.shape(0) != xa.shape(1) || r->a.dtype() != xa.dtype() ||
        w->a.dtype() != xa.dtype()) {
      throw std::invalid_argument("wm_add_rms_norm: x, r [R, H] and w [H] of one dtype expected");
    }
    int rows = xa.shape(0), h = xa.shape(1);
    if (h % 8 != 0 || h > 16384 || !(xa.dtype() == mx::bfloat16 || xa.dtype() == mx::float16)) {
      throw std::invalid_argument("wm_add_rms_norm: bf16/f16 rows of a multiple of 8 up to 16384");
    }
    int eps_bits;
    std::memcpy(&eps_bits, &eps, sizeof(eps_bits));
    auto o = add_rms_norm_kernel()({xa, r->a, w->a}, {{rows, h}, {rows, h}},
                                   {xa.dtype(), xa.dtype()}, {rows * 256, 1, 1}, {256, 1, 1},
                                   {{"T", xa.dtype()}, {"H", h}, {"EPS_BITS", eps_bits}},
                                   std::nullopt, false, stream(s));
    *sum = wrap(o[0]);
    *out = wrap(o[1]);
  });
}

int wm_quantized_matmul(wm_array x, wm_array w, wm_array scales, wm_array biases,
                        int32_t group_size, int32_t bits, wm_stream s, wm_array* out) {
  return guarded([&] {
    *out = wrap(mx::quantized_matmul(x->a, w->a, scales->a, biases->a, true, group_size, bits,
                                     "affine", stream(s)));
  });
}

int wm_quantize(wm_array w, int32_t group_size, int32_t bits, wm_stream s, wm_array* wq,
                wm_array* scales, wm_array* biases) {
  return guarded([&] {
    auto r = mx::quantize(w->a, group_size, bits, "affine", std::nullopt, stream(s));
    if (r.size() != 3) throw std::runtime_error("affine quantize did not return 3 arrays");
    *wq = wrap(r[0]);
    *scales = wrap(r[1]);
    *biases = wrap(r[2]);
  });
}

int wm_dequantize(wm_array w, wm_array scales, wm_array biases, int32_t group_size,
                  int32_t bits, wm_stream s, wm_array* out) {
  return guarded([&] {
    *out = wrap(mx::dequantize(w->a, scales->a, biases->a, group_size, bits, "affine",
                               std::nullopt, std::nullopt, stream(s)));
  });
}

int wm_rms_norm(wm_array x, wm_array weight, float eps, wm_stream s, wm_array* out) {
  return guarded([&] { *out = wrap(mx::fast::rms_norm(x->a, weight->a, eps, stream(s))); });
}

int wm_rope(wm_array x, int32_t dims, int32_t traditional, float base, float scale,
            int32_t offset, wm_array offsets, wm_array freqs, wm_stream s, wm_array* out) {
  return guarded([&] {
    std::optional<float> b = freqs ? std::nullopt : std::optional<float>(base);
    std::optional<mx::array> f = freqs ? std::optional<mx::array>(freqs->a) : std::nullopt;
    if (offsets) {
      *out = wrap(mx::fast::rope(x->a, dims, traditional != 0, b, scale, offsets->a, f, stream(s)));
    } else {
      *out = wrap(mx::fast::rope(x->a, dims, traditional != 0, b, scale, offset, f, stream(s)));
    }
  });
}

int wm_sdpa(wm_array q, wm_array k, wm_array v, float scale, int32_t mask_mode, wm_array mask,
            wm_stream s, wm_array* out) {
  return guarded([&] {
    std::string mode = mask_mode == 1 ? "causal" : (mask_mode == 2 ? "array" : "");
    std::optional<mx::array> m =
        mask_mode == 2 ? std::optional<mx::array>(mask->a) : std::nullopt;
    *out = wrap(mx::fast::scaled_dot_product_attention(q->a, k->a, v->a, scale, mode, m, {},
                                                       false, stream(s)));
  });
}

}  // extern "C"
