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

mx::array silu(const mx::array& x) { return mx::multiply(x, mx::sigmoid(x)); }

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
mx::array gelu_tanh(const mx::array& x) {
  auto c = mx::array(std::sqrt(2.0f / static_cast<float>(M_PI)), x.dtype());
  auto inner = mx::multiply(c, mx::add(x, mx::multiply(mx::array(0.044715f, x.dtype()),
                                                       mx::multiply(x, mx::multiply(x, x)))));
  return mx::multiply(mx::multiply(mx::array(0.5f, x.dtype()), x),
                      mx::add(mx::array(1.0f, x.dtype()), mx::tanh(inner)));
}

std::vector<mx::array> silu_mul(const std::vector<mx::array>& in) {
  return {mx::multiply(silu(in[0]), in[1])};
}

std::vector<mx::array> gelu_tanh_mul(const std::vector<mx::array>& in) {
  return {mx::multiply(gelu_tanh(in[0]), in[1])};
}

std::vector<mx::array> silu_of(const std::vector<mx::array>& in) { return {silu(in[0])}; }

std::vector<mx::array> gelu_tanh_of(const std::vector<mx::array>& in) {
  return {gelu_tanh(in[0])};
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


// The gated DeltaNet (see wm_gated_delta in shim.h), in float32 throughout.
namespace delta {

constexpr int CHUNK = 64;

mx::array scalar(float v) { return mx::array(v, mx::float32); }

// x / sqrt(sum x^2 + 1e-6) over the last axis (flash-linear-attention's l2norm).
mx::array l2norm(const mx::array& x, mx::StreamOrDevice st) {
  auto ss = mx::sum(mx::square(x, st), -1, true, st);
  return mx::multiply(x, mx::rsqrt(mx::add(ss, scalar(1e-6f), st), st), st);
}

// torch's softplus: linear above 20.
mx::array softplus(const mx::array& x, mx::StreamOrDevice st) {
  auto soft = mx::log1p(mx::exp(mx::minimum(x, scalar(20.0f), st), st), st);
  return mx::where(mx::greater(x, scalar(20.0f), st), x, soft, st);
}

// Token by token: q, k [B, H, m, kd], v [B, H, m, vd], g, beta [B, H, m]; state [B, H, kd, vd].
mx::array recurrent(const mx::array& q, const mx::array& k, const mx::array& v,
                    const mx::array& g, const mx::array& beta, mx::array& state,
                    mx::StreamOrDevice st) {
  int b = q.shape(0), h = q.shape(1), m = q.shape(2), kd = q.shape(3);
  std::vector<mx::array> outs;
  outs.reserve(m);
  auto at = [&](const mx::array& x, int t) {
    mx::Shape start(x.ndim(), 0), stop = x.shape();
    start[2] = t;
    stop[2] = t + 1;
    return mx::slice(x, start, stop, st);
  };
  for (int t = 0; t < m; ++t) {
    auto qt = at(q, t);                                            // [B, H, 1, kd]
    auto kt = at(k, t);                                            // [B, H, 1, kd]
    auto vt = at(v, t);                                            // [B, H, 1, vd]
    auto decay = mx::reshape(mx::exp(at(g, t), st), {b, h, 1, 1}, st);
    auto bt = mx::reshape(at(beta, t), {b, h, 1, 1}, st);
    state = mx::multiply(state, decay, st);
    auto kv = mx::matmul(kt, state, st);                           // [B, H, 1, vd]
    auto d = mx::multiply(mx::subtract(vt, kv, st), bt, st);
    state = mx::add(state, mx::matmul(mx::reshape(kt, {b, h, kd, 1}, st), d, st), st);
    outs.push_back(mx::matmul(qt, state, st));                     // [B, H, 1, vd]
  }
  return mx::concatenate(outs, 2, st);
}

// The chunked (UT-transform) form, the same result up to rounding: inside a chunk of L
// tokens with G the cumulative log decay, A = strict_lower(beta K K^T * exp(G_i - G_j)),
// T = (I + A)^-1 (by forward substitution, every chunk at once), U = T beta V,
// W = T beta K exp(G); then chunk by chunk V' = U - W S,
// O = exp(G) Q S + lower(Q K^T * exp(G_i - G_j)) V', S = exp(G_L) S + (K exp(G_L - G))^T V'.
mx::array chunked(const mx::array& q0, const mx::array& k0, const mx::array& v0,
                  const mx::array& g0, const mx::array& beta0, mx::array& state,
                  mx::StreamOrDevice st) {
  int b = q0.shape(0), h = q0.shape(1), m = q0.shape(2), kd = q0.shape(3), vd = v0.shape(3);
  int n = (m + CHUNK - 1) / CHUNK, padded = n * CHUNK, l = CHUNK;
  // Zero rows past the end: no decay, no write, outputs dropped.
  auto pad = [&](const mx::array& x) {
    if (padded == m) return x;
    std::vector<std::pair<int, int>> widths(x.ndim(), {0, 0});
    widths[2] = {0, padded - m};
    return mx::pad(x, widths, scalar(0.0f), "constant", st);
  };
  auto q = mx::reshape(pad(q0), {b, h, n, l, kd}, st);
  auto k = mx::reshape(pad(k0), {b, h, n, l, kd}, st);
  auto v = mx::reshape(pad(v0), {b, h, n, l, vd}, st);
  auto g = mx::reshape(pad(g0), {b, h, n, l}, st);
  auto beta = mx::reshape(pad(beta0), {b, h, n, l, 1}, st);
  auto cg = mx::cumsum(g, -1, false, true, st);                    // [B, H, n, L]
  auto ci = mx::expand_dims(cg, -1, st), cj = mx::expand_dims(cg, -2, st);
  auto lower = mx::tril(mx::ones({l, l}, mx::bool_, st), 0, st);
  auto strict = mx::tril(mx::ones({l, l}, mx::bool_, st), -1, st);
  auto diff = mx::subtract(ci, cj, st);                            // [B, H, n, L, L]
  auto zero = scalar(0.0f);
  auto decay = mx::exp(mx::where(lower, diff, zero, st), st);
  auto kt = mx::swapaxes(k, -1, -2, st);
  auto kb = mx::multiply(k, beta, st);
  auto a = mx::where(strict, mx::multiply(mx::matmul(kb, kt, st), decay, st), zero, st);
  auto p = mx::where(lower, mx::multiply(mx::matmul(q, kt, st), decay, st), zero, st);
  // Rows of T - I: row i = -A_i - A_i (T - I) over the rows before it.
  auto t = mx::negative(a, st);
  for (int i = 1; i < l; ++i) {
    auto row = mx::slice(t, {0, 0, 0, i, 0}, {b, h, n, i + 1, i}, st);
    auto sub = mx::slice(t, {0, 0, 0, 0, 0}, {b, h, n, i, i}, st);
    auto next = mx::add(row, mx::matmul(row, sub, st), st);
    t = mx::slice_update(t, next, mx::Shape{0, 0, 0, i, 0}, mx::Shape{b, h, n, i + 1, i}, st);
  }
  t = mx::add(t, mx::eye(l, l, 0, mx::float32, st), st);
  auto u = mx::matmul(t, mx::multiply(v, beta, st), st);           // [B, H, n, L, vd]
  auto eg = mx::expand_dims(mx::exp(cg, st), -1, st);              // [B, H, n, L, 1]
  auto w = mx::matmul(t, mx::multiply(kb, eg, st), st);            // [B, H, n, L, kd]
  auto qg = mx::multiply(q, eg, st);
  auto chunk = [&](const mx::array& x, int c) {
    mx::Shape start(x.ndim(), 0), stop = x.shape();
    start[2] = c;
    stop[2] = c + 1;
    auto s = stop;
    s.erase(s.begin() + 2);
    return mx::reshape(mx::slice(x, start, stop, st), s, st);
  };
  std::vector<mx::array> outs;
  outs.reserve(n);
  for (int c = 0; c < n; ++c) {
    auto vn = mx::subtract(chunk(u, c), mx::matmul(chunk(w, c), state, st), st);
    outs.push_back(mx::add(mx::matmul(chunk(qg, c), state, st),
                           mx::matmul(chunk(p, c), vn, st), st));
    auto gc = chunk(cg, c);                                        // [B, H, L]
    auto last = mx::slice(gc, {0, 0, l - 1}, {b, h, l}, st);       // [B, H, 1]
    auto tail = mx::expand_dims(mx::exp(mx::subtract(last, gc, st), st), -1, st);
    auto kw = mx::multiply(chunk(k, c), tail, st);                 // [B, H, L, kd]
    state = mx::add(mx::multiply(state, mx::expand_dims(mx::exp(last, st), -1, st), st),
                    mx::matmul(mx::swapaxes(kw, -1, -2, st), vn, st), st);
  }
  auto o = mx::concatenate(outs, 2, st);                           // [B, H, padded, vd]
  return mx::slice(o, {0, 0, 0, 0}, {b, h, m, vd}, st);
}

}  // namespace delta

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

int wm_activation(wm_array x, int32_t act, wm_stream s, wm_array* out) {
  return guarded([&] {
    static auto silu = mx::compile(silu_of, /* shapeless = */ true);
    static auto gelu = mx::compile(gelu_tanh_of, /* shapeless = */ true);
    mx::set_default_stream(stream(s));
    auto& f = act == 0 ? silu : gelu;
    *out = wrap(f({x->a})[0]);
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

int wm_layer_norm(wm_array x, wm_array weight, wm_array bias, float eps, wm_stream s,
                  wm_array* out) {
  return guarded([&] {
    std::optional<mx::array> w = weight ? std::optional<mx::array>(weight->a) : std::nullopt;
    std::optional<mx::array> b = bias ? std::optional<mx::array>(bias->a) : std::nullopt;
    *out = wrap(mx::fast::layer_norm(x->a, w, b, eps, stream(s)));
  });
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

int wm_sigmoid_gate(wm_array x, wm_array gate, wm_stream s, wm_array* out) {
  return guarded([&] {
    auto st = stream(s);
    auto g = mx::sigmoid(mx::astype(gate->a, mx::float32, st), st);
    auto y = mx::multiply(mx::astype(x->a, mx::float32, st), g, st);
    *out = wrap(mx::astype(y, x->a.dtype(), st));
  });
}

int wm_gated_delta(wm_array qkv, wm_array z, wm_array b, wm_array a, wm_array conv,
                   wm_array ssm, wm_array conv_w, wm_array neg_a, wm_array dt_bias,
                   wm_array norm, const int32_t* dims, float eps, int32_t chunked, wm_stream s,
                   wm_array* out, wm_array* conv_out, wm_array* ssm_out) {
  return guarded([&] {
    auto st = stream(s);
    const int kh = dims[0], vh = dims[1], kd = dims[2], vd = dims[3];
    const auto f32 = mx::float32;
    const auto& x0 = qkv->a;
    if (x0.ndim() != 3 || conv->a.ndim() != 3 || ssm->a.ndim() != 4 || conv_w->a.ndim() != 2) {
      throw std::invalid_argument("wm_gated_delta: qkv [B, m, C], conv [B, K-1, C], ssm [B, H, kd, vd]");
    }
    const int nb = x0.shape(0), m = x0.shape(1), cd = x0.shape(2), kernel = conv_w->a.shape(1);
    if (cd != 2 * kh * kd + vh * vd || kh <= 0 || vh % kh != 0 ||
        conv->a.shape() != mx::Shape{nb, kernel - 1, cd} ||
        ssm->a.shape() != mx::Shape{nb, vh, kd, vd} || conv_w->a.shape(0) != cd) {
      throw std::invalid_argument("wm_gated_delta: shapes do not fit the layer");
    }
    // The causal convolution over the carried inputs and the new ones, then SiLU.
    auto ext = mx::concatenate({conv->a, mx::astype(x0, f32, st)}, 1, st);  // [B, K-1+m, C]
    auto y = mx::zeros({nb, m, cd}, f32, st);
    for (int j = 0; j < kernel; ++j) {
      auto tap = mx::reshape(mx::slice(conv_w->a, {0, j}, {cd, j + 1}, st), {cd}, st);
      y = mx::add(y, mx::multiply(mx::slice(ext, {0, j, 0}, {nb, j + m, cd}, st), tap, st), st);
    }
    y = mx::multiply(y, mx::sigmoid(y, st), st);
    *conv_out = wrap(mx::slice(ext, {0, m, 0}, {nb, m + kernel - 1, cd}, st));
    // Per-head queries and keys (normalized, repeated to the value heads) and values,
    // heads first: [B, H, m, d].
    auto heads = [&](int from, int count, int d) {
      auto part = mx::slice(y, {0, 0, from}, {nb, m, from + count * d}, st);
      return mx::transpose(mx::reshape(part, {nb, m, count, d}, st), {0, 2, 1, 3}, st);
    };
    auto q = mx::multiply(delta::l2norm(heads(0, kh, kd), st),
                          delta::scalar(1.0f / std::sqrt(static_cast<float>(kd))), st);
    auto k = delta::l2norm(heads(kh * kd, kh, kd), st);
    auto v = heads(2 * kh * kd, vh, vd);
    if (vh != kh) {
      q = mx::repeat(q, vh / kh, 1, st);
      k = mx::repeat(k, vh / kh, 1, st);
    }
    auto head_major = [&](const mx::array& t) {                     // [B, m, H] -> [B, H, m]
      return mx::transpose(mx::astype(t, f32, st), {0, 2, 1}, st);
    };
    auto beta = mx::sigmoid(head_major(b->a), st);
    auto sp = delta::softplus(mx::add(head_major(a->a), mx::reshape(dt_bias->a, {vh, 1}, st), st), st);
    auto g = mx::multiply(mx::reshape(neg_a->a, {vh, 1}, st), sp, st);
    mx::array state = ssm->a;
    auto o = chunked != 0 ? delta::chunked(q, k, v, g, beta, state, st)
                          : delta::recurrent(q, k, v, g, beta, state, st);
    *ssm_out = wrap(state);
    // The gated RMS norm per head: w * o / rms(o) * silu(z).
    o = mx::transpose(o, {0, 2, 1, 3}, st);                          // [B, m, H, vd]
    auto ms = mx::mean(mx::square(o, st), -1, true, st);
    auto normed = mx::multiply(mx::multiply(o, mx::rsqrt(mx::add(ms, delta::scalar(eps), st), st), st),
                               norm->a, st);
    auto zz = mx::reshape(mx::astype(z->a, f32, st), {nb, m, vh, vd}, st);
    auto gated = mx::multiply(normed, mx::multiply(zz, mx::sigmoid(zz, st), st), st);
    *out = wrap(mx::astype(mx::reshape(gated, {nb, m, vh * vd}, st), x0.dtype(), st));
  });
}
