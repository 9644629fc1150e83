// wick's CUDA kernels, compiled at run time by NVRTC for the device in use.
//
// Activations are f32, row-major. Weight matrices (`[out, in]`) are f32, f16, bf16 or
// affine-quantized at 4 or 8 bits.
// No CUDA headers are included (NVRTC finds none on a machine that only has the driver and
// the runtime libraries): half-precision values are carried as 16-bit integers and
// converted here.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WICK_INF __int_as_float(0x7f800000)

struct Bf16 { u16 v; };
struct F16 { u16 v; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(Bf16 x) { return __uint_as_float(((u32)x.v) << 16); }
__device__ __forceinline__ float to_f32(F16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.v));
    return f;
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}
__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Eight consecutive weights as floats (`p` 16-byte aligned).
__device__ __forceinline__ void load8(const float* p, float* o) {
    float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
    o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void unpack_bf16(uint4 v, float* o) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        o[2 * i] = __uint_as_float(w[i] << 16);
        o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void load8(const Bf16* p, float* o) { unpack_bf16(*(const uint4*)p, o); }
__device__ __forceinline__ void load8(const F16* p, float* o) {
    uint4 v = *(const uint4*)p;
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        F16 lo = {(u16)(w[i] & 0xffffu)}, hi = {(u16)(w[i] >> 16)};
        o[2 * i] = to_f32(lo);
        o[2 * i + 1] = to_f32(hi);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of at most 1024 threads; every thread gets the total.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)((blockDim.x + 31) >> 5) ? part[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    float t = total;
    __syncthreads();
    return t;
}

// Programmatic dependent launch (sm_90 and later; the host launches a kernel this way only
// right after another of these kernels). Every kernel first lets the next one start
// (`pdl_launch`: its blocks may then take free SM slots and run up to their `pdl_wait`),
// then waits until the kernel before it has finished and its writes are visible
// (`pdl_wait`). Nothing but weights (never written while a pass runs) may be read, and
// nothing written, before the wait; so a kernel's launch and block scheduling overlap the
// tail of the kernel before. (Prefetching a product's weights into L2 before the wait was
// measured slower on the H200: most blocks never wait, and the prefetch doubled their L2
// requests.) Without the launch attribute (older GPUs, `WICK_CUDA_PDL=0`) both are no-ops.
__device__ __forceinline__ void pdl_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_begin() {
    pdl_launch();
    pdl_wait();
}


// ---------------------------------------------------------------------------------------
// Products
//
// Dense weights are f32, f16 or bf16. Affine-quantized weights (MLX's layout; GGUF blocks
// that fit it are re-laid out into it at load) pack each row's values little-endian at BITS
// (4 or 8) bits, with a scale s and a bias b of type S for every group of `group` inputs,
// so w = s·q + b. One 16-byte load holds QC = 128 / BITS values, all in one group (groups
// are 32, 64 or 128 inputs).

typedef unsigned char u8;

// The QC values of one 16-byte load as exact floats (0x4b000000 | q is 2^23 + q).
template <int BITS>
__device__ __forceinline__ void unpack_q(uint4 p, float* q) {
    u32 w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (BITS == 8) {
#pragma unroll
            for (int k = 0; k < 4; k++)
                q[4 * i + k] = __uint_as_float(__byte_perm(w[i], 0x4b000000u, 0x7540 + k)) - 8388608.0f;
        } else {
            u32 lo = w[i] & 0x0f0f0f0fu, hi = (w[i] >> 4) & 0x0f0f0f0fu;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                q[8 * i + 2 * k] = __uint_as_float(__byte_perm(lo, 0x4b000000u, 0x7540 + k)) - 8388608.0f;
                q[8 * i + 2 * k + 1] = __uint_as_float(__byte_perm(hi, 0x4b000000u, 0x7540 + k)) - 8388608.0f;
            }
        }
    }
}

// A gated unit's activation of `g` (kind 0: SiLU, 1: GELU tanh).
__device__ __forceinline__ float act(float g, int kind) {
    if (kind == 0) return g / (1.0f + expf(-g));
    const float c = 0.7978845608028654f;
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
}

// Products of few rows by blocks: each block of RB_THREADS threads makes two outputs; its
// threads split the inputs in 16-byte loads (so a short row still spreads over many SMs
// and every thread has its loads in flight at once) and the block sums their parts.
#define RB_THREADS 128

// Sums each thread's a0[r] (output o) and a1[r] (output o + 1) over the block and stores
// them (+ bias) into rows r of y; with `glu` ≥ 0 (an activation kind) the two are a gate
// and its up projection, and act(gate)·up is stored at o; with `mul`, each output is a
// gate of mul's value at its place: act(sum, mact)·mul is stored.
template <int NR>
__device__ __forceinline__ void block_store(float* a0, float* a1, float b0, float b1,
                                            bool second, int glu, float* y, int out, int o,
                                            const float* mul, int mact) {
    __shared__ float part[RB_THREADS / 32][16];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < NR; r++) {
        float s0 = warp_sum(a0[r]), s1 = warp_sum(a1[r]);
        if (lane == 0) {
            part[warp][r] = s0;
            part[warp][8 + r] = s1;
        }
    }
    __syncthreads();
    int t = threadIdx.x;
    if (glu >= 0) {
        if (t < NR) {
            float g = 0.0f, u = 0.0f;
#pragma unroll
            for (int k = 0; k < RB_THREADS / 32; k++) {
                g += part[k][t];
                u += part[k][8 + t];
            }
            y[(u64)t * out + o] = act(g, glu) * u;
        }
    } else if (t < 2 * NR) {
        int r = t % NR, which = t / NR;
        if (which == 0 || second) {
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < RB_THREADS / 32; k++) s += part[k][8 * which + r];
            u64 at = (u64)r * out + o + which;
            s += which ? b1 : b0;
            y[at] = mul ? act(s, mact) * mul[at] : s;
        }
    }
    __syncthreads();
}

// This thread's part of w0 · x[r] and w1 · x[r] for NR rows of x (dense weights).
template <typename T, int NR>
__device__ __forceinline__ void dense_part(const float* __restrict__ x, const T* __restrict__ w0,
                                           const T* __restrict__ w1, int in, float* a0,
                                           float* a1) {
#pragma unroll
    for (int r = 0; r < NR; r++) {
        a0[r] = 0.0f;
        a1[r] = 0.0f;
    }
    if ((in & 7) == 0) {
#pragma unroll 4
        for (int i = threadIdx.x * 8; i < in; i += RB_THREADS * 8) {
            float u[8], v[8];
            load8(w0 + i, u);
            load8(w1 + i, v);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                float xv[8];
                load8(x + (u64)r * in + i, xv);
                float s0 = a0[r], s1 = a1[r];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    s0 = fmaf(u[j], xv[j], s0);
                    s1 = fmaf(v[j], xv[j], s1);
                }
                a0[r] = s0;
                a1[r] = s1;
            }
        }
    } else {
        for (int i = threadIdx.x; i < in; i += RB_THREADS) {
            float u = to_f32(w0[i]), v = to_f32(w1[i]);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                float xv = x[(u64)r * in + i];
                a0[r] = fmaf(u, xv, a0[r]);
                a1[r] = fmaf(v, xv, a1[r]);
            }
        }
    }
}

// Four signed bytes from four ints in [-127, 127] (a in the lowest byte).
__device__ __forceinline__ u32 pack_s8(int a, int b, int c, int d) {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// c + Σ a_k·b_k over the four bytes of a (unsigned) and b (signed).
__device__ __forceinline__ int dot4(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// One thread's QC inputs of a few-row affine product (those its 16-byte weight load
// covers) quantized to signed bytes with one scale, as llama.cpp's CUDA mat-vec does
// (`dx` · q ≈ x, |q| ≤ 127): the products' inner sums are then byte dot products (4 per
// instruction, exact in int32) instead of a float FMA per weight, which had held the 4-bit
// kernel to half the memory bandwidth by instruction issue. Words are laid out as the
// weights' bytes: at 8 bits, word k holds inputs 4k..4k+3; at 4 bits, word 2i the inputs of
// the low nibbles of weight word i (8i, 8i+2, 8i+4, 8i+6) and word 2i + 1 those of the high
// ones. `sum` is Σ q (for the groups' biases).
template <int BITS>
__device__ __forceinline__ void quantize_x(const float* __restrict__ x, u32* xq, float& dx,
                                           float& sum) {
    const int QC = 128 / BITS;
    float v[QC];
#pragma unroll
    for (int q = 0; q < QC / 4; q++) {
        float4 f = ((const float4*)x)[q];
        v[4 * q] = f.x;
        v[4 * q + 1] = f.y;
        v[4 * q + 2] = f.z;
        v[4 * q + 3] = f.w;
    }
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < QC; e++) amax = fmaxf(amax, fabsf(v[e]));
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    dx = amax * (1.0f / 127.0f);
    int qi[QC];
#pragma unroll
    for (int e = 0; e < QC; e++) qi[e] = __float2int_rn(v[e] * inv);
    int s = 0;
#pragma unroll
    for (int k = 0; k < QC / 4; k++) {
        if (BITS == 8) {
            xq[k] = pack_s8(qi[4 * k], qi[4 * k + 1], qi[4 * k + 2], qi[4 * k + 3]);
        } else {
            int b = 8 * (k >> 1) + (k & 1);
            xq[k] = pack_s8(qi[b], qi[b + 2], qi[b + 4], qi[b + 6]);
        }
        s = dot4(0x01010101u, xq[k], s);
    }
    sum = (float)s;
}

// Rows of an affine matrix one block of a few-row product makes (`AFFINE_ROWS` in Rust), so
// that each thread has 128 bytes of weights in flight per step and each quantized load of
// x serves as many weight rows. The products take passes of up to two rows of x: with
// more, their values crowd out the weights' registers, and a product of more rows
// dequantizes the matrix for cuBLAS instead.
#define AFFINE_ROWS 8

// This thread's part of W affine rows (the first `nw` real: the others repeat the last)
// times NR rows of x: per 16-byte load of each row (one group), the byte dot product Σq·qx
// with the thread's quantized inputs, turned into dx·(s·Σq·qx + b·Σqx).
// With GLU, rows j < W/2 are the block's first `nw` gate rows and rows j ≥ W/2 the up
// rows `up` rows further on.
template <typename S, int BITS, int W, int NR, bool GLU>
__device__ __forceinline__ void affine_part(const float* __restrict__ x, const u8* __restrict__ w,
                                            const S* __restrict__ scales,
                                            const S* __restrict__ biases, int nw, int up,
                                            int in, int group, float (&acc)[W][NR]) {
    const int QC = 128 / BITS;
    u64 row_bytes = (u64)in * BITS / 8;
    int groups = in / group;
#pragma unroll
    for (int j = 0; j < W; j++)
#pragma unroll
        for (int r = 0; r < NR; r++) acc[j][r] = 0.0f;
    for (int i = threadIdx.x * QC; i < in; i += RB_THREADS * QC) {
        // The inputs first (from L2, written by the kernel before): their quantization's
        // temporaries are dead by the time the weights' registers fill, so more blocks fit.
        u32 xq[NR][QC / 4];
        float dx[NR], sq[NR];
#pragma unroll
        for (int r = 0; r < NR; r++) quantize_x<BITS>(x + (u64)r * in + i, xq[r], dx[r], sq[r]);
        uint4 p[W];
        float sc[W], bi[W];
        int g = i / group;
#pragma unroll
        for (int j = 0; j < W; j++) {
            int row = GLU ? (j < W / 2 ? min(j, nw - 1) : up + min(j - W / 2, nw - 1))
                          : min(j, nw - 1);
            p[j] = *(const uint4*)(w + row * row_bytes + i * BITS / 8);
            sc[j] = to_f32(scales[(u64)row * groups + g]);
            bi[j] = to_f32(biases[(u64)row * groups + g]);
        }
#pragma unroll
        for (int j = 0; j < W; j++) {
            u32 word[4] = {p[j].x, p[j].y, p[j].z, p[j].w};
#pragma unroll
            for (int r = 0; r < NR; r++) {
                int d = 0;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    if (BITS == 8) {
                        d = dot4(word[k], xq[r][k], d);
                    } else {
                        d = dot4(word[k] & 0x0f0f0f0fu, xq[r][2 * k], d);
                        d = dot4((word[k] >> 4) & 0x0f0f0f0fu, xq[r][2 * k + 1], d);
                    }
                }
                acc[j][r] = fmaf(dx[r], fmaf(sc[j], (float)d, bi[j] * sq[r]), acc[j][r]);
            }
        }
    }
}

// Sums acc over the block and stores y[r, o + j] = Σ acc[j][r] (+ bias) for the block's
// `nw` outputs starting at o; with `glu` ≥ 0 (GLU), rows j < W/2 are gates and j + W/2
// their up projections, and act(gate)·up is stored for the `nw` pairs.
template <int W, int NR, bool GLU>
__device__ __forceinline__ void block_store_rows(float (&acc)[W][NR], const float* bias,
                                                 float* y, int out, int o, int nw, int glu) {
    __shared__ float part[RB_THREADS / 32][W * NR];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < W; j++)
#pragma unroll
        for (int r = 0; r < NR; r++) {
            float s = warp_sum(acc[j][r]);
            if (lane == 0) part[warp][j * NR + r] = s;
        }
    __syncthreads();
    int t = threadIdx.x;
    if (GLU) {
        if (t < W / 2 * NR) {
            int j = t / NR, r = t % NR;
            if (j < nw) {
                float g = 0.0f, u = 0.0f;
#pragma unroll
                for (int k = 0; k < RB_THREADS / 32; k++) {
                    g += part[k][t];
                    u += part[k][t + W / 2 * NR];
                }
                y[(u64)r * out + o + j] = act(g, glu) * u;
            }
        }
    } else if (t < W * NR) {
        int j = t / NR, r = t % NR;
        if (j < nw) {
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < RB_THREADS / 32; k++) s += part[k][t];
            y[(u64)r * out + o + j] = s + (bias ? bias[o + j] : 0.0f);
        }
    }
    __syncthreads();
}

// Passes of up to MAXR rows of x over one block's two weight rows: `pass.run<n>(r0)` for
// each. Each MAXR is its own kernel, so that a step of one row does not pay the registers
// of eight (a kernel's register count is that of its largest path).
template <int MAXR, typename Pass>
__device__ __forceinline__ void row_passes(int rows, const Pass& pass) {
    for (int r0 = 0; r0 < rows; r0 += MAXR) {
        switch (min(MAXR, rows - r0)) {
            case 1: pass.template run<1>(r0); break;
            case 2: pass.template run<(MAXR >= 2 ? 2 : 1)>(r0); break;
            case 3: pass.template run<(MAXR >= 3 ? 3 : 1)>(r0); break;
            case 4: pass.template run<(MAXR >= 4 ? 4 : 1)>(r0); break;
            case 5: pass.template run<(MAXR >= 5 ? 5 : 1)>(r0); break;
            case 6: pass.template run<(MAXR >= 6 ? 6 : 1)>(r0); break;
            case 7: pass.template run<(MAXR >= 7 ? 7 : 1)>(r0); break;
            default: pass.template run<(MAXR >= 8 ? 8 : 1)>(r0); break;
        }
    }
}

// One block's outputs o and o + 1 (if `second`) with their biases.
// (With `glu` ≥ 0: the block's two rows are a gate and its up projection, and its one
// output is act(gate)·up at o.)
// (With `mul`: each output is act(sum, mact) times mul's value at its place.)
struct Outputs {
    float* y;
    int out, o;
    float b0, b1;
    bool second;
    int glu;
    const float* mul;
    int mact;
    __device__ Outputs(float* y_, const float* bias, int out_, int o_, int glu_ = -1,
                       const float* mul_ = nullptr, int mact_ = 0)
        : y(y_), out(out_), o(o_), second(glu_ >= 0 || o_ + 1 < out_), glu(glu_), mul(mul_),
          mact(mact_) {
        b0 = bias ? bias[o] : 0.0f;
        b1 = bias && second ? bias[o + 1] : 0.0f;
    }
    template <int N>
    __device__ __forceinline__ void store(float* a0, float* a1, int r0) const {
        block_store<N>(a0, a1, b0, b1, second, glu, y + (u64)r0 * out, out, o,
                       mul ? mul + (u64)r0 * out : nullptr, mact);
    }
};

template <typename T>
struct DensePass {
    const float* x;
    const T* w0;
    const T* w1;
    int in;
    Outputs dst;
    template <int N>
    __device__ __forceinline__ void run(int r0) const {
        float a0[N], a1[N];
        dense_part<T, N>(x + (u64)r0 * in, w0, w1, in, a0, a1);
        dst.template store<N>(a0, a1, r0);
    }
};

// Outputs o and o + 1 of y = x·wᵀ (+ bias) for `rows` rows of x.
template <typename T, int MAXR>
__device__ __forceinline__ void linear_block_at(const float* __restrict__ x,
                                                const T* __restrict__ w,
                                                const float* __restrict__ bias,
                                                float* __restrict__ y, int rows, int in, int out,
                                                int o) {
    if (o >= out) return;
    pdl_launch();
    const T* w0 = w + (u64)o * in;
    pdl_wait();
    Outputs dst(y, bias, out, o);
    DensePass<T> pass = {x, w0, dst.second ? w0 + in : w0, in, dst};
    row_passes<MAXR>(rows, pass);
}

// act(x·wᵀ) · mul for `rows` rows of x, outputs o and o + 1 of the block: a product that
// gates another tensor (Gemma 4's per-layer inputs) with no separate GLU launch.
template <typename T, int MAXR>
__device__ void linear_mul_block(const float* __restrict__ x, const T* __restrict__ w,
                                 const float* __restrict__ mul, float* __restrict__ y,
                                 int rows, int in, int out, int act_kind) {
    int o = 2 * blockIdx.x;
    if (o >= out) return;
    pdl_launch();
    const T* w0 = w + (u64)o * in;
    pdl_wait();
    Outputs dst(y, nullptr, out, o, -1, mul, act_kind);
    DensePass<T> pass = {x, w0, dst.second ? w0 + in : w0, in, dst};
    row_passes<MAXR>(rows, pass);
}

template <typename T, int MAXR>
__device__ void linear_block(const float* __restrict__ x, const T* __restrict__ w,
                             const float* __restrict__ bias, float* __restrict__ y, int rows,
                             int in, int out) {
    linear_block_at<T, MAXR>(x, w, bias, y, rows, in, out, 2 * blockIdx.x);
}

// Up to three matrices (`out2` may be 0) multiplying the same rows of x, such as a layer's
// query, key and value projections, in one launch: the blocks of each matrix follow those
// of the one before, so the small ones share the card with the big one.
template <typename T, int MAXR>
__device__ void linear_many(const float* __restrict__ x, const T* __restrict__ w0,
                            const T* __restrict__ w1, const T* __restrict__ w2,
                            float* __restrict__ y0, float* __restrict__ y1,
                            float* __restrict__ y2, int rows, int in, int out0, int out1,
                            int out2) {
    int b = blockIdx.x, n0 = (out0 + 1) / 2, n1 = (out1 + 1) / 2;
    if (b >= n0 + n1)
        linear_block_at<T, MAXR>(x, w2, nullptr, y2, rows, in, out2, 2 * (b - n0 - n1));
    else if (b >= n0)
        linear_block_at<T, MAXR>(x, w1, nullptr, y1, rows, in, out1, 2 * (b - n0));
    else
        linear_block_at<T, MAXR>(x, w0, nullptr, y0, rows, in, out0, 2 * b);
}

// y[r, i] = act(gate_i · x[r]) · (up_i · x[r]) for a fused `[gate; up]` matrix (`width`
// rows each): a block per pair of rows, so no product output or GLU pass in between.
template <typename T, int MAXR>
__device__ void glu_block(const float* __restrict__ x, const T* __restrict__ w,
                          float* __restrict__ y, int rows, int in, int width, int act_kind) {
    int i = blockIdx.x;
    if (i >= width) return;
    pdl_launch();
    const T* w0 = w + (u64)i * in;
    const T* w1 = w + (u64)(width + i) * in;
    pdl_wait();
    Outputs dst(y, nullptr, width, i, act_kind);
    DensePass<T> pass = {x, w0, w1, in, dst};
    row_passes<MAXR>(rows, pass);
}

#define BLOCK_ENTRY(T, TN, R)                                                                  \
    extern "C" __global__ void __launch_bounds__(RB_THREADS) linear_block_##TN##_r##R(        \
        const float* x, const T* w, const float* bias, float* y, int rows, int in, int out) {  \
        linear_block<T, R>(x, w, bias, y, rows, in, out);                                      \
    }
#define GLU_BLOCK_ENTRY(T, TN, R)                                                              \
    extern "C" __global__ void __launch_bounds__(RB_THREADS) glu_block_##TN##_r##R(           \
        const float* x, const T* w, float* y, int rows, int in, int width, int act_kind) {     \
        glu_block<T, R>(x, w, y, rows, in, width, act_kind);                                   \
    }
#define MANY_ENTRY(T, TN, R)                                                                   \
    extern "C" __global__ void __launch_bounds__(RB_THREADS) linear_many_##TN##_r##R(         \
        const float* x, const T* w0, const T* w1, const T* w2, float* y0, float* y1,           \
        float* y2, int rows, int in, int out0, int out1, int out2) {                           \
        linear_many<T, R>(x, w0, w1, w2, y0, y1, y2, rows, in, out0, out1, out2);              \
    }
#define MUL_ENTRY(T, TN, R)                                                                    \
    extern "C" __global__ void __launch_bounds__(RB_THREADS) linear_mul_block_##TN##_r##R(    \
        const float* x, const T* w, const float* mul, float* y, int rows, int in, int out,     \
        int act_kind) {                                                                        \
        linear_mul_block<T, R>(x, w, mul, y, rows, in, out, act_kind);                         \
    }
#define BLOCK_ENTRIES(T, TN)                                                                   \
    BLOCK_ENTRY(T, TN, 1) BLOCK_ENTRY(T, TN, 2) BLOCK_ENTRY(T, TN, 4) BLOCK_ENTRY(T, TN, 8)    \
    GLU_BLOCK_ENTRY(T, TN, 1) GLU_BLOCK_ENTRY(T, TN, 2) MANY_ENTRY(T, TN, 1)                   \
    MANY_ENTRY(T, TN, 2) MUL_ENTRY(T, TN, 1) MUL_ENTRY(T, TN, 2)
BLOCK_ENTRIES(float, f32)
BLOCK_ENTRIES(F16, f16)
BLOCK_ENTRIES(Bf16, bf16)

template <typename S, int BITS, int W, bool GLU>
struct AffinePass {
    const float* x;
    const u8* w;
    const S* scales;
    const S* biases;
    const float* bias;
    float* y;
    int nw, up, in, out, o, group, glu;
    template <int N>
    __device__ __forceinline__ void run(int r0) const {
        float acc[W][N];
        affine_part<S, BITS, W, N, GLU>(x + (u64)r0 * in, w, scales, biases, nw, up, in, group,
                                        acc);
        block_store_rows<W, N, GLU>(acc, bias, y + (u64)r0 * out, out, o, nw, glu);
    }
};

// A few-row product with an affine matrix: AFFINE_ROWS outputs per block.
template <typename S, int BITS, int MAXR>
__device__ void linear_affine(const float* __restrict__ x, const u8* __restrict__ w,
                              const S* __restrict__ scales, const S* __restrict__ biases,
                              const float* __restrict__ bias, float* __restrict__ y, int rows,
                              int in, int out, int group) {
    const int W = AFFINE_ROWS;
    int o = W * blockIdx.x;
    if (o >= out) return;
    pdl_launch();
    int groups = in / group, nw = min(W, out - o);
    pdl_wait();
    AffinePass<S, BITS, W, false> pass = {
        x,  w + (u64)o * in * BITS / 8, scales + (u64)o * groups, biases + (u64)o * groups,
        bias, y, nw, 0, in, out, o, group, -1};
    row_passes<MAXR>(rows, pass);
}

// `glu_block` for an affine `[gate; up]` matrix: AFFINE_ROWS / 2 pairs per block.
template <typename S, int BITS, int MAXR>
__device__ void glu_affine(const float* __restrict__ x, const u8* __restrict__ w,
                           const S* __restrict__ scales, const S* __restrict__ biases,
                           float* __restrict__ y, int rows, int in, int width, int group,
                           int act_kind) {
    const int W = AFFINE_ROWS;
    int o = W / 2 * blockIdx.x;
    if (o >= width) return;
    pdl_launch();
    int groups = in / group, nw = min(W / 2, width - o);
    u64 row_bytes = (u64)in * BITS / 8;
    pdl_wait();
    AffinePass<S, BITS, W, true> pass = {
        x,  w + (u64)o * row_bytes, scales + (u64)o * groups, biases + (u64)o * groups,
        nullptr, y, nw, width, in, width, o, group, act_kind};
    row_passes<MAXR>(rows, pass);
}

// The matrix as bf16 (what a product of many rows hands to cuBLAS): one thread per load.
template <typename S, int BITS>
__device__ void dequant_affine(const u8* __restrict__ w, const S* __restrict__ scales,
                               const S* __restrict__ biases, u16* __restrict__ out,
                               long long loads, int in, int group) {
    const int QC = 128 / BITS;
    for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < loads;
         c += (long long)gridDim.x * blockDim.x) {
        long long first = c * QC;
        long long row = first / in;
        int at = (int)(first - row * in);
        long long g = row * (in / group) + at / group;
        float s = to_f32(scales[g]), b = to_f32(biases[g]);
        float q[QC];
        unpack_q<BITS>(((const uint4*)w)[c], q);
        uint4* dst = (uint4*)(out + first);
#pragma unroll
        for (int k = 0; k < QC / 8; k++) {
            u32 o[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float lo = __fadd_rn(__fmul_rn(s, q[8 * k + 2 * j]), b);
                float hi = __fadd_rn(__fmul_rn(s, q[8 * k + 2 * j + 1]), b);
                o[j] = (u32)f32_to_bf16_bits(lo) | ((u32)f32_to_bf16_bits(hi) << 16);
            }
            uint4 v;
            v.x = o[0]; v.y = o[1]; v.z = o[2]; v.w = o[3];
            dst[k] = v;
        }
    }
}

// Blocks of a few-row affine product that fit an SM at once (ptxas keeps the registers to
// that): each thread holds 128 bytes of weights in flight, so these set the bytes in flight
// per SM, which is what the products' speed follows.
#define AFFINE_MIN_BLOCKS(BITS, R) ((BITS) == 4 && (R) == 2 ? 4 : 5)

#define AFFINE_LINEAR(S, SN, BITS, R)                                                          \
    extern "C" __global__ void __launch_bounds__(RB_THREADS, AFFINE_MIN_BLOCKS(BITS, R)) linear_q##BITS##_##SN##_r##R( \
        const float* x, const u8* w, const S* scales, const S* biases, const float* bias,      \
        float* y, int rows, int in, int out, int group) {                                      \
        linear_affine<S, BITS, R>(x, w, scales, biases, bias, y, rows, in, out, group);        \
    }
#define AFFINE_GLU(S, SN, BITS, R)                                                             \
    extern "C" __global__ void __launch_bounds__(RB_THREADS, AFFINE_MIN_BLOCKS(BITS, R)) glu_q##BITS##_##SN##_r##R( \
        const float* x, const u8* w, const S* scales, const S* biases, float* y, int rows,     \
        int in, int width, int group, int act_kind) {                                          \
        glu_affine<S, BITS, R>(x, w, scales, biases, y, rows, in, width, group, act_kind);     \
    }
#define AFFINE_ENTRIES(S, SN, BITS)                                                            \
    AFFINE_LINEAR(S, SN, BITS, 1) AFFINE_LINEAR(S, SN, BITS, 2)                                \
    AFFINE_GLU(S, SN, BITS, 1) AFFINE_GLU(S, SN, BITS, 2)                                      \
    extern "C" __global__ void dequant_q##BITS##_##SN(const u8* w, const S* scales,           \
                                                      const S* biases, u16* out,               \
                                                      long long loads, int in, int group) {    \
        pdl_begin();                                                                           \
        dequant_affine<S, BITS>(w, scales, biases, out, loads, in, group);                     \
    }                                                                                          \
    extern "C" __global__ void embed_q##BITS##_##SN(const u8* w, const S* scales,             \
                                                    const S* biases, const u32* ids,           \
                                                    float* out, int hidden, int group) {       \
        pdl_begin();                                                                           \
        embed_affine<S, BITS>(w, scales, biases, ids, out, hidden, group);                     \
    }
// (instantiated after embed_affine, in "Embeddings")

// f32 as bf16 (kind 0) or f16 (kind 1) bits: the input of a cuBLAS product with half
// weights.
__device__ __forceinline__ u16 to_half_bits(float v, int kind) {
    return kind == 0 ? f32_to_bf16_bits(v) : f32_to_f16_bits(v);
}

// f32 → bf16 (kind 0) or f16 (kind 1), the input of a cuBLAS product with half weights:
// four values a thread where the sizes and addresses allow 16-byte loads.
extern "C" __global__ void to_half(const float* x, u16* out, long long n, int kind) {
    pdl_begin();
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if ((n & 3) == 0 && ((u64)x & 15) == 0 && ((u64)out & 7) == 0) {
        for (long long i = i0; i < n / 4; i += stride) {
            float4 v = ((const float4*)x)[i];
            uint2 h;
            h.x = (u32)to_half_bits(v.x, kind) | ((u32)to_half_bits(v.y, kind) << 16);
            h.y = (u32)to_half_bits(v.z, kind) | ((u32)to_half_bits(v.w, kind) << 16);
            ((uint2*)out)[i] = h;
        }
        return;
    }
    for (long long i = i0; i < n; i += stride) out[i] = to_half_bits(x[i], kind);
}

// y[r, c] += bias[c]
extern "C" __global__ void add_bias(float* y, const float* bias, long long n, int cols) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] += bias[i % cols];
}

// ---------------------------------------------------------------------------------------
// Embeddings

// Row kernels run on a grid of (rows, column blocks): one thread per value, so that even
// a single row spreads over many SMs.
__device__ __forceinline__ int col() { return blockIdx.y * blockDim.x + threadIdx.x; }

template <typename T>
__device__ void embed(const T* table, const u32* ids, float* out, int hidden) {
    int i = col();
    if (i < hidden) out[(u64)blockIdx.x * hidden + i] = to_f32(table[(u64)ids[blockIdx.x] * hidden + i]);
}
extern "C" __global__ void embed_f32(const float* t, const u32* ids, float* out, int hidden) {
    pdl_begin();
    embed<float>(t, ids, out, hidden);
}
extern "C" __global__ void embed_f16(const F16* t, const u32* ids, float* out, int hidden) {
    pdl_begin();
    embed<F16>(t, ids, out, hidden);
}
extern "C" __global__ void embed_bf16(const Bf16* t, const u32* ids, float* out, int hidden) {
    pdl_begin();
    embed<Bf16>(t, ids, out, hidden);
}

// Rows of an affine table (exactly as the host dequantizes: s·q, then + b).
template <typename S, int BITS>
__device__ void embed_affine(const u8* w, const S* scales, const S* biases, const u32* ids,
                             float* out, int hidden, int group) {
    int i = col();
    if (i >= hidden) return;
    u64 row = ids[blockIdx.x];
    const u8* p = w + row * ((u64)hidden * BITS / 8);
    u32 q = BITS == 8 ? p[i] : (p[i >> 1] >> ((i & 1) * 4)) & 15u;
    u64 g = row * (hidden / group) + i / group;
    out[(u64)blockIdx.x * hidden + i] =
        __fadd_rn(__fmul_rn(to_f32(scales[g]), (float)q), to_f32(biases[g]));
}
// Every affine kernel, for each side type and width.
AFFINE_ENTRIES(Bf16, bf16, 8)
AFFINE_ENTRIES(F16, f16, 8)
AFFINE_ENTRIES(float, f32, 8)
AFFINE_ENTRIES(Bf16, bf16, 4)
AFFINE_ENTRIES(F16, f16, 4)
AFFINE_ENTRIES(float, f32, 4)

// ---------------------------------------------------------------------------------------
// Elementwise

extern "C" __global__ void add(const float* a, const float* b, float* out, long long n) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}

extern "C" __global__ void scale(const float* x, float* out, float s, long long n) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = x[i] * s;
}

extern "C" __global__ void softcap(const float* x, float* out, float cap, long long n) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = cap * tanhf(x[i] / cap);
}


// out = act(gate) * up (kind 0: SiLU, 1: GELU tanh).
extern "C" __global__ void glu(const float* gate, const float* up, float* out, long long n,
                               int kind) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = act(gate[i], kind) * up[i];
}

#define NORM_CACHE 8

// A norm's output value, and its half copy when one is asked for.
__device__ __forceinline__ void norm_store(float* out, u16* half, int kind, u64 i, float v) {
    out[i] = v;
    if (half) half[i] = to_half_bits(v, kind);
}

// RMS norm of each `n`-long group, one block per group; each thread keeps its values
// (up to NORM_CACHE of them) in registers between the sum and the scaling.
// `half` (when not null) receives a copy of `out` as bf16 (`kind` 0) or f16 (1) bits: the
// input of the cuBLAS product that follows, without a pass of its own (`to_half`).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int n, float eps,
                                    u16* __restrict__ half, int kind) {
    pdl_begin();
    u64 base = (u64)blockIdx.x * n;
    float v[NORM_CACHE];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        v[c] = i < n ? x[base + i] : 0.0f;
        ss = fmaf(v[c], v[c], ss);
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x)
        ss = fmaf(x[base + i], x[base + i], ss);
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        if (i < n) norm_store(out, half, kind, base + i, v[c] * inv * w[i]);
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x)
        norm_store(out, half, kind, base + i, x[base + i] * inv * w[i]);
}

// sum = x + y; out = rms_norm(sum) · w, per `n`-long group (as `rms_norm`).
extern "C" __global__ void add_rms_norm(const float* __restrict__ x, const float* __restrict__ y,
                                        const float* __restrict__ w, float* __restrict__ sum,
                                        float* __restrict__ out, int n, float eps,
                                        u16* __restrict__ half, int kind) {
    pdl_begin();
    u64 base = (u64)blockIdx.x * n;
    float v[NORM_CACHE];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        v[c] = i < n ? x[base + i] + y[base + i] : 0.0f;
        if (i < n) sum[base + i] = v[c];
        ss = fmaf(v[c], v[c], ss);
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x) {
        float t = x[base + i] + y[base + i];
        sum[base + i] = t;
        ss = fmaf(t, t, ss);
    }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        if (i < n) norm_store(out, half, kind, base + i, v[c] * inv * w[i]);
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x)
        norm_store(out, half, kind, base + i, (x[base + i] + y[base + i]) * inv * w[i]);
}

// s = (x + rms_norm(y) · post) · scale per `n`-long group (a sandwich-normed block's output
// joining the residual stream), and with `next` also out = rms_norm(s) · next (the next
// block's input norm): what `rms_norm`, `add`, `scale` and `rms_norm` did, with the same
// roundings (no contraction into fused multiply-adds), in one launch.
extern "C" __global__ void add_post_norm(const float* __restrict__ x, const float* __restrict__ y,
                                         const float* __restrict__ post,
                                         const float* __restrict__ next, float* __restrict__ sum,
                                         float* __restrict__ out, int n, float eps, float scale,
                                         u16* __restrict__ half, int kind) {
    pdl_begin();
    u64 base = (u64)blockIdx.x * n;
    float v[NORM_CACHE];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        v[c] = i < n ? y[base + i] : 0.0f;
        ss = fmaf(v[c], v[c], ss);
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x)
        ss = fmaf(y[base + i], y[base + i], ss);
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    float ss2 = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        if (i < n) {
            float t = __fadd_rn(x[base + i], __fmul_rn(__fmul_rn(v[c], inv), post[i]));
            if (scale != 1.0f) t = __fmul_rn(t, scale);
            v[c] = t;
            sum[base + i] = t;
            ss2 = fmaf(t, t, ss2);
        }
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x) {
        float t = __fadd_rn(x[base + i], __fmul_rn(__fmul_rn(y[base + i], inv), post[i]));
        if (scale != 1.0f) t = __fmul_rn(t, scale);
        sum[base + i] = t;
        ss2 = fmaf(t, t, ss2);
    }
    if (next == nullptr) return;  // the same for every thread of the block
    ss2 = block_sum(ss2);
    float inv2 = 1.0f / sqrtf(ss2 / (float)n + eps);
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        if (i < n) norm_store(out, half, kind, base + i, v[c] * inv2 * next[i]);
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x)
        norm_store(out, half, kind, base + i, sum[base + i] * inv2 * next[i]);
}

#define HEAD_MAX 1024

// One head of `norm_rope_heads`: head h of the queries' `qh`, then the keys' `kn` and the
// values' `vn` heads (values are normalized, not rotated).
struct NormHead {
    const float* src;
    const float* w;
    float* dst;
    u64 off;
    bool rotate;
    __device__ NormHead(int r, int h, const float* q, const float* qw, float* q_out,
                        const float* k, const float* kw, float* k_out, const float* v,
                        const float* vw, float* v_out, int qh, int kn, int vn, int hd)
        : src(q), w(qw), dst(q_out), rotate(true) {
        int heads = qh;
        if (h >= qh + kn) {
            h -= qh + kn;
            src = v, w = vw, dst = v_out, heads = vn, rotate = false;
        } else if (h >= qh) {
            h -= qh;
            src = k, w = kw, dst = k_out, heads = kn;
        }
        off = ((u64)r * heads + h) * hd;
    }
    // Stores values d = first, first + step, … of the head (`head`: its values, read by
    // every thread that stores) times `inv` and the weights, rotated.
    __device__ __forceinline__ void store(const float* head, float inv, const float* cs,
                                          int rows, int r, int hd, int dims, int neox,
                                          int first, int step) const {
        int half = dims / 2;
        const float* cosr = cs + (u64)r * half;
        const float* sinr = cs + (u64)rows * half + (u64)r * half;
        for (int d = first; d < hd; d += step) {
            if (!rotate || d >= dims) {
                dst[off + d] = head[d] * inv * w[d];
                continue;
            }
            int i, lo, hi;
            bool first_of_pair;
            if (neox) {
                i = d < half ? d : d - half;
                lo = i, hi = i + half, first_of_pair = d < half;
            } else {
                i = d >> 1;
                lo = 2 * i, hi = 2 * i + 1, first_of_pair = (d & 1) == 0;
            }
            float a = head[lo] * inv * w[lo], b = head[hi] * inv * w[hi];
            dst[off + d] = first_of_pair ? a * cosr[i] - b * sinr[i] : a * sinr[i] + b * cosr[i];
        }
    }
};

// Per-head RMS norms, then rotary embeddings: block (r, h) takes head h of row r among the
// queries' `qh` heads, then the keys' `kn` and the values' `vn` (norm only; either count may
// be 0), each head of `hd` values normalized by its own weights (`qw`, `kw`, `vw`: one
// head's). What `rms_norm` (one block per head, one value a thread) and `rope_qk` did,
// with the same roundings, in one launch; `cs` as in `rope`.
extern "C" __global__ void norm_rope_heads(const float* __restrict__ q,
                                           const float* __restrict__ qw, float* __restrict__ q_out,
                                           const float* __restrict__ k,
                                           const float* __restrict__ kw, float* __restrict__ k_out,
                                           const float* __restrict__ v,
                                           const float* __restrict__ vw, float* __restrict__ v_out,
                                           const float* __restrict__ cs, int rows, int qh, int kn,
                                           int vn, int hd, int dims, int neox, float eps) {
    pdl_begin();
    __shared__ float head[HEAD_MAX];
    int r = blockIdx.x;
    NormHead x(r, blockIdx.y, q, qw, q_out, k, kw, k_out, v, vw, v_out, qh, kn, vn, hd);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float t = x.src[x.off + i];
        head[i] = t;
        ss = fmaf(t, t, ss);
    }
    ss = block_sum(ss);  // its barriers also publish `head`
    float inv = 1.0f / sqrtf(ss / (float)hd + eps);
    x.store(head, inv, cs, rows, r, hd, dims, neox, threadIdx.x, blockDim.x);
}

// `norm_rope_heads` for a prompt's many rows: a warp per head (NORM_HEAD_WARPS heads of row
// `blockIdx.x` a block, from head NORM_HEAD_WARPS · blockIdx.y), so no block-wide barrier
// stands between a head's sum and its stores (one block per head and one value a thread
// left the kernel at a third of the copy bandwidth on Gemma 4's 4,096-row prompts).
#define NORM_HEAD_WARPS 8
extern "C" __global__ void __launch_bounds__(NORM_HEAD_WARPS * 32)
    norm_rope_heads_warps(const float* __restrict__ q, const float* __restrict__ qw,
                          float* __restrict__ q_out, const float* __restrict__ k,
                          const float* __restrict__ kw, float* __restrict__ k_out,
                          const float* __restrict__ v, const float* __restrict__ vw,
                          float* __restrict__ v_out, const float* __restrict__ cs, int rows,
                          int qh, int kn, int vn, int hd, int dims, int neox, float eps) {
    pdl_begin();
    __shared__ float heads[NORM_HEAD_WARPS][HEAD_MAX];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x, h = blockIdx.y * NORM_HEAD_WARPS + warp;
    if (h >= qh + kn + vn) return;
    NormHead x(r, h, q, qw, q_out, k, kw, k_out, v, vw, v_out, qh, kn, vn, hd);
    float* head = heads[warp];
    float ss = 0.0f;
    for (int i = lane; i < hd; i += 32) {
        float t = x.src[x.off + i];
        head[i] = t;
        ss = fmaf(t, t, ss);
    }
    ss = warp_sum(ss);
    __syncwarp();
    float inv = 1.0f / sqrtf(ss / (float)hd + eps);
    x.store(head, inv, cs, rows, r, hd, dims, neox, lane, 32);
}

// Value `idx` of row r of x (rows `stride` floats apart, heads of `hd` from the start of
// each row) after rotary embeddings: `cs` holds `rows * half` cosines then as many sines.
__device__ __forceinline__ float rope_value_at(const float* x, u64 stride, const float* cs,
                                               int rows, int r, int hd, int dims, int neox,
                                               int idx) {
    int half = dims / 2;
    const float* cosr = cs + (u64)r * half;
    const float* sinr = cs + (u64)rows * half + (u64)r * half;
    const float* xh = x + (u64)r * stride + (idx / hd) * hd;
    int d = idx % hd;
    if (d >= dims) return xh[d];
    if (neox) {
        int i = d < half ? d : d - half;
        float a = xh[i], b = xh[i + half];
        return d < half ? a * cosr[i] - b * sinr[i] : a * sinr[i] + b * cosr[i];
    }
    int i = d >> 1;
    float a = xh[2 * i], b = xh[2 * i + 1];
    return (d & 1) == 0 ? a * cosr[i] - b * sinr[i] : a * sinr[i] + b * cosr[i];
}

// `rope_value_at` of a tensor of `heads` heads of `hd` a row.
__device__ __forceinline__ float rope_value(const float* x, const float* cs, int rows, int r,
                                            int heads, int hd, int dims, int neox, int idx) {
    return rope_value_at(x, (u64)heads * hd, cs, rows, r, hd, dims, neox, idx);
}

// A rotary table: row r's `half` cosines, then (after all rows' cosines) its sines, of the
// angle positions[r * stride + axis] * scale * inv_freq[i], where axis is axes[i] (M-RoPE's
// temporal, row or column position) or 0 without axes; in f64, then scaled by `factor` in f32,
// so the values are the host's `sin_cos` tables.
extern "C" __global__ void rope_table(const int* positions, int stride, const unsigned char* axes,
                                      const float* inv_freq, float* out, int rows, int half,
                                      float scale, float factor) {
    pdl_begin();
    int r = blockIdx.x, i = col();
    if (i < half) {
        int axis = axes ? axes[i] : 0;
        double p = (double)positions[(u64)r * stride + axis] * (double)scale;
        double s, c;
        sincos(p * (double)inv_freq[i], &s, &c);
        out[(u64)r * half + i] = (float)c * factor;
        out[(u64)rows * half + (u64)r * half + i] = (float)s * factor;
    }
}

// Rotary embeddings of each row's `heads` heads.
extern "C" __global__ void rope(const float* x, float* out, const float* cs, int rows,
                                int heads, int hd, int dims, int neox) {
    pdl_begin();
    int r = blockIdx.x, idx = col();
    if (idx < heads * hd)
        out[(u64)r * heads * hd + idx] = rope_value(x, cs, rows, r, heads, hd, dims, neox, idx);
}

// `rope` of a layer's queries (`qh` heads) and keys (`kh` heads) in one launch.
extern "C" __global__ void rope_qk(const float* q, float* q_out, const float* k, float* k_out,
                                   const float* cs, int rows, int qh, int kh, int hd, int dims,
                                   int neox) {
    pdl_begin();
    int r = blockIdx.x, idx = col();
    if (idx < qh * hd) {
        q_out[(u64)r * qh * hd + idx] = rope_value(q, cs, rows, r, qh, hd, dims, neox, idx);
    } else if (idx < (qh + kh) * hd) {
        idx -= qh * hd;
        k_out[(u64)r * kh * hd + idx] = rope_value(k, cs, rows, r, kh, hd, dims, neox, idx);
    }
}

// A fused q/k/v product's rows (`qh` query heads, then `kh` key and `kh` value heads, of
// `hd` each) split into q and k after rotary embeddings, and v: what `copy_cols` three
// times and `rope_qk` did, reading each value once.
extern "C" __global__ void rope_qkv(const float* qkv, float* q_out, float* k_out, float* v_out,
                                    const float* cs, int rows, int qh, int kh, int hd, int dims,
                                    int neox) {
    pdl_begin();
    int r = blockIdx.x, idx = col();
    int qn = qh * hd, kn = kh * hd;
    u64 stride = (u64)qn + 2 * kn;
    if (idx < qn) {
        q_out[(u64)r * qn + idx] = rope_value_at(qkv, stride, cs, rows, r, hd, dims, neox, idx);
    } else if (idx < qn + kn) {
        idx -= qn;
        k_out[(u64)r * kn + idx] =
            rope_value_at(qkv + qn, stride, cs, rows, r, hd, dims, neox, idx);
    } else if (idx < qn + 2 * kn) {
        idx -= qn + kn;
        v_out[(u64)r * kn + idx] = qkv[(u64)r * stride + qn + kn + idx];
    }
}

// act(gate) · up of a fused gate/up product's rows (`width` gate columns, then as many up
// columns): what `copy_cols` twice and `glu` did, reading each value once; with `half`, a
// bf16 (`hkind` 0) or f16 (1) copy of the output too (as `rms_norm`).
extern "C" __global__ void glu_split(const float* both, float* out, int width, int kind,
                                     u16* half, int hkind) {
    pdl_begin();
    int c = col();
    if (c < width) {
        const float* row = both + (u64)blockIdx.x * 2 * width;
        norm_store(out, half, hkind, (u64)blockIdx.x * width + c, act(row[c], kind) * row[width + c]);
    }
}

// glu_split of a product stored in bf16 (`bkind` 0) or f16 (1).
extern "C" __global__ void glu_split_half(const u16* both, int bkind, float* out, int width,
                                          int kind, u16* half, int hkind) {
    pdl_begin();
    int c = col();
    if (c < width) {
        const u16* row = both + (u64)blockIdx.x * 2 * width;
        float g = bkind == 0 ? to_f32(Bf16{row[c]}) : to_f32(F16{row[c]});
        float u = bkind == 0 ? to_f32(Bf16{row[width + c]}) : to_f32(F16{row[width + c]});
        norm_store(out, half, hkind, (u64)blockIdx.x * width + c, act(g, kind) * u);
    }
}

// out[i, :] = x[idx[i], :]
extern "C" __global__ void gather_rows(const float* x, const u32* idx, float* out, int cols) {
    pdl_begin();
    int c = col();
    if (c < cols) out[(u64)blockIdx.x * cols + c] = x[(u64)idx[blockIdx.x] * cols + c];
}

// out[r, :] = x[r, off .. off + width]
extern "C" __global__ void copy_cols(const float* x, float* out, int in_cols, int off,
                                     int width) {
    pdl_begin();
    int c = col();
    if (c < width) out[(u64)blockIdx.x * width + c] = x[(u64)blockIdx.x * in_cols + off + c];
}

// y[idx[i], :] += d[i, :] (in place; the rows are distinct).
extern "C" __global__ void scatter_add_rows(float* y, const u32* idx, const float* d, int cols) {
    pdl_begin();
    int c = col();
    if (c < cols) y[(u64)idx[blockIdx.x] * cols + c] += d[(u64)blockIdx.x * cols + c];
}

// ---------------------------------------------------------------------------------------
// Mixture of experts, routed on the device. A layer's experts are stacked: `[gate; up]` of
// expert e is rows e·2I .. (e+1)·2I of `[E·2I, H]`, its down projection rows e·H .. (e+1)·H
// of `[E·H, I]`. Row r's k routed experts are slots r·k .. r·k + k, in rank order: `ids`
// and `weights` `[n, k]`. Nothing here depends on the routing but the data read, so a
// decode step's launches are the same every step (graph replay).

#define MOE_MAX_EXPERTS 4096

// The better of two (probability, expert) candidates: the larger, the lower index among
// equals (a NaN never wins).
__device__ __forceinline__ void moe_better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

// Gemma 4's router, one block per row of `logits` [n, E]: softmax, the k most probable
// (the earlier expert first among equals), their probabilities renormalised to sum to one,
// each times its expert's `scale`. Blocks of 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_route(const float* __restrict__ logits,
                                                         const float* __restrict__ scale,
                                                         int* __restrict__ ids,
                                                         float* __restrict__ weights, int E,
                                                         int k) {
    __shared__ float p[MOE_MAX_EXPERTS];
    __shared__ float best_v[8];
    __shared__ int best_i[8];
    __shared__ float stat;
    pdl_begin();
    const float* l = logits + (u64)blockIdx.x * E;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // The maximum (as a sum's block reduction, with max).
    float m = -WICK_INF;
    for (int i = threadIdx.x; i < E; i += blockDim.x) m = fmaxf(m, l[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) best_v[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = best_v[0];
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) t = fmaxf(t, best_v[w]);
        stat = t;
    }
    __syncthreads();
    m = stat;
    float s = 0.0f;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        float v = expf(l[i] - m);
        p[i] = v;
        s += v;
    }
    s = block_sum(s);
    for (int i = threadIdx.x; i < E; i += blockDim.x) p[i] = p[i] / s;
    __syncthreads();
    int* row_ids = ids + (u64)blockIdx.x * k;
    float* row_w = weights + (u64)blockIdx.x * k;
    for (int kk = 0; kk < k; kk++) {
        float v = -WICK_INF;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < E; i += blockDim.x) moe_better(v, bi, p[i], i);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float v2 = __shfl_xor_sync(0xffffffffu, v, o);
            int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
            moe_better(v, bi, v2, i2);
        }
        if (lane == 0) {
            best_v[warp] = v;
            best_i[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < (int)(blockDim.x >> 5); w++) moe_better(v, bi, best_v[w], best_i[w]);
            if (bi >= E) {
                // Only NaNs (or picked experts) left: the first expert not yet picked.
                bi = 0;
                while (bi < E - 1 && p[bi] == -WICK_INF) bi++;
                v = 0.0f;
            }
            row_ids[kk] = bi;
            row_w[kk] = v;
            p[bi] = -WICK_INF;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int kk = 0; kk < k; kk++) total += row_w[kk];
        for (int kk = 0; kk < k; kk++) row_w[kk] = row_w[kk] / total * scale[row_ids[kk]];
    }
}

__device__ __forceinline__ int moe_expert(const int* ids, int s, int E) {
    return min(max(ids[s], 0), E - 1);
}

// Decode rows, one mat-vec per routed slot: h[s, i] = act(gate_e,i · x[s / k]) ·
// (up_e,i · x[s / k]) with e = ids[s]; a block per (i, s), grid (I, n·k). Only the routed
// experts' rows are read.
template <typename T>
__device__ void moe_glu_vec(const float* __restrict__ x, const T* __restrict__ w,
                            const int* __restrict__ ids, float* __restrict__ h, int k, int in,
                            int width, int E, int act_kind) {
    int i = blockIdx.x, s = blockIdx.y;
    pdl_begin();
    int e = moe_expert(ids, s, E);
    const T* w0 = w + ((u64)e * 2 * width + i) * in;
    const T* w1 = w0 + (u64)width * in;
    Outputs dst(h + (u64)s * width, nullptr, width, i, act_kind);
    DensePass<T> pass = {x + (u64)(s / k) * in, w0, w1, in, dst};
    pass.template run<1>(0);
}

// Decode rows' down projections and their weighted sum: y[r, o] = Σ_kk weights[r, kk] ·
// (down_e,o · h[r·k + kk]) with e = ids[r, kk], outputs o and o + 1 a block, grid
// (⌈H / 2⌉, n). A block's threads weight their parts of each slot's dot product, so the
// block's one sum is the row's.
template <typename T>
__device__ void moe_down_vec(const float* __restrict__ h, const T* __restrict__ w,
                             const int* __restrict__ ids, const float* __restrict__ weights,
                             float* __restrict__ y, int k, int in, int out, int E) {
    int o = 2 * blockIdx.x, r = blockIdx.y;
    if (o >= out) return;
    pdl_begin();
    bool second = o + 1 < out;
    float s0 = 0.0f, s1 = 0.0f;
    for (int kk = 0; kk < k; kk++) {
        int slot = r * k + kk;
        int e = moe_expert(ids, slot, E);
        float g = weights[slot];
        const T* w0 = w + ((u64)e * out + o) * in;
        float a0[1], a1[1];
        dense_part<T, 1>(h + (u64)slot * in, w0, second ? w0 + in : w0, in, a0, a1);
        s0 = fmaf(g, a0[0], s0);
        s1 = fmaf(g, a1[0], s1);
    }
    Outputs dst(y + (u64)r * out, nullptr, out, o);
    dst.template store<1>(&s0, &s1, 0);
}

// Prompt chunks and batches: the slots sorted by expert and multiplied a tile of slots of
// one expert at a time. One block of 1024 threads: `order` [n·k] lists the slots expert by
// expert, and `tiles` [max, 3] each expert's runs of at most MOE_TM of them (expert, first
// position in `order`, count), `tiles_n[0]` of them.
#define MOE_TM 64
#define MOE_TN 64
#define MOE_TK 16

extern "C" __global__ void __launch_bounds__(1024) moe_sort(const int* __restrict__ ids,
                                                         int* __restrict__ order,
                                                         int* __restrict__ tiles,
                                                         int* __restrict__ tiles_n, int nk,
                                                         int E) {
    __shared__ int count[MOE_MAX_EXPERTS];
    __shared__ int cursor[MOE_MAX_EXPERTS];
    pdl_begin();
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < nk; s += blockDim.x) atomicAdd(&count[moe_expert(ids, s, E)], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0, t = 0;
        for (int e = 0; e < E; e++) {
            cursor[e] = at;
            for (int p = 0; p < count[e]; p += MOE_TM) {
                tiles[3 * t] = e;
                tiles[3 * t + 1] = at + p;
                tiles[3 * t + 2] = min(MOE_TM, count[e] - p);
                t++;
            }
            at += count[e];
        }
        tiles_n[0] = t;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < nk; s += blockDim.x)
        order[atomicAdd(&cursor[moe_expert(ids, s, E)], 1)] = s;
}

// out[order[p], c] = a[order[p] / a_div] · w[e·per + c] for the positions p of tile
// blockIdx.x (expert e) and the MOE_TN columns c of blockIdx.y (`per` columns a slot, `in`
// inputs). Blocks of 256 threads, each making 4 × 4 outputs; past `tiles_n[0]` a block
// does nothing.
template <typename T>
__device__ void moe_grouped(const float* __restrict__ a, const int* __restrict__ order,
                            const int* __restrict__ tiles, const int* __restrict__ tiles_n,
                            const T* __restrict__ w, float* __restrict__ out, int a_div,
                            int per, int in) {
    __shared__ float as[MOE_TK][MOE_TM + 4];
    __shared__ float ws[MOE_TK][MOE_TN + 4];
    pdl_begin();
    int t = blockIdx.x;
    if (t >= tiles_n[0]) return;
    int e = tiles[3 * t], p0 = tiles[3 * t + 1], len = tiles[3 * t + 2];
    int c0 = blockIdx.y * MOE_TN;
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    // Loads: thread (row lr + 16j, input kk) of both tiles.
    int kk = threadIdx.x & 15, lr = threadIdx.x >> 4;
    const float* arow[4];
    const T* wrow[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int m = lr + 16 * j;
        arow[j] = m < len ? a + (u64)(order[p0 + m] / a_div) * in : nullptr;
        int c = c0 + m;
        wrow[j] = c < per ? w + ((u64)e * per + c) * in : nullptr;
    }
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < in; k0 += MOE_TK) {
        int col = k0 + kk;
        bool inside = col < in;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            as[kk][lr + 16 * j] = arow[j] && inside ? arow[j][col] : 0.0f;
            ws[kk][lr + 16 * j] = wrow[j] && inside ? to_f32(wrow[j][col]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < MOE_TK; q++) {
            float av[4], wv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                av[i] = as[q][ty * 4 + i];
                wv[i] = ws[q][tx * 4 + i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(av[i], wv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int m = ty * 4 + i;
        if (m >= len) continue;
        float* o = out + (u64)order[p0 + m] * per;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int c = c0 + tx * 4 + j;
            if (c < per) o[c] = acc[i][j];
        }
    }
}

// h[s, i] = act(gu[s, i]) · gu[s, width + i] for the n·k slots' fused gate and up outputs.
extern "C" __global__ void moe_glu_rows(const float* __restrict__ gu, float* __restrict__ h,
                                        long long n, int width, int act_kind) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long s = i / width, c = i % width;
        const float* g = gu + s * 2 * width;
        h[i] = act(g[c], act_kind) * g[width + c];
    }
}

// y[r, c] = Σ_kk weights[r, kk] · ys[r·k + kk, c]; grid (n, column blocks of 256).
extern "C" __global__ void moe_combine(const float* __restrict__ ys,
                                       const float* __restrict__ weights,
                                       float* __restrict__ y, int k, int cols) {
    pdl_begin();
    int c = col();
    if (c >= cols) return;
    u64 r = blockIdx.x;
    float s = 0.0f;
    for (int kk = 0; kk < k; kk++) s = fmaf(weights[r * k + kk], ys[(r * k + kk) * cols + c], s);
    y[r * cols + c] = s;
}

#define MOE_ENTRIES(T, TN)                                                                     \
    extern "C" __global__ void __launch_bounds__(RB_THREADS) moe_glu_vec_##TN(                 \
        const float* x, const T* w, const int* ids, float* h, int k, int in, int width, int E, \
        int act_kind) {                                                                        \
        moe_glu_vec<T>(x, w, ids, h, k, in, width, E, act_kind);                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(RB_THREADS) moe_down_vec_##TN(                \
        const float* h, const T* w, const int* ids, const float* weights, float* y, int k,     \
        int in, int out, int E) {                                                              \
        moe_down_vec<T>(h, w, ids, weights, y, k, in, out, E);                                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) moe_grouped_##TN(                        \
        const float* a, const int* order, const int* tiles, const int* tiles_n, const T* w,    \
        float* out, int a_div, int per, int in) {                                              \
        moe_grouped<T>(a, order, tiles, tiles_n, w, out, a_div, per, in);                      \
    }
MOE_ENTRIES(float, f32)
MOE_ENTRIES(F16, f16)
MOE_ENTRIES(Bf16, bf16)

// ---------------------------------------------------------------------------------------
// Attention over per-sequence caches. A segment is one sequence's rows of the flattened
// batch and its cache: keys and values `[capacity][kv_heads][hd]`, f32 or f16.

struct Seg {
    u64 k;
    u64 v;
    int len_before;  // tokens cached before this pass's rows
    int row_start;   // first row of the flattened batch
    int rows;
    int window;      // 0: none
};

// A tile: `n` consecutive rows of one segment, from flattened row `row0`.
struct Tile {
    int row0;
    int n;
};

// Writes each row's keys and values at its position (as f16 when `half`).
extern "C" __global__ void kv_append(const float* k, const float* v, const Seg* segs,
                                     const int* seg_of_row, int row, int half) {
    pdl_begin();
    int r = blockIdx.x;
    Seg s = segs[seg_of_row[r]];
    u64 at = (u64)(s.len_before + r - s.row_start) * row;
    int i = col();
    if (i < row) {
        float kv = k[(u64)r * row + i], vv = v[(u64)r * row + i];
        if (half) {
            ((u16*)s.k)[at + i] = f32_to_f16_bits(kv);
            ((u16*)s.v)[at + i] = f32_to_f16_bits(vv);
        } else {
            ((float*)s.k)[at + i] = kv;
            ((float*)s.v)[at + i] = vv;
        }
    }
}

#define ATTN_WARPS 4

// One step of `transpose_sum`: lanes with bit OFF set keep the upper half of v[0..2·OFF].
template <int OFF, int N>
__device__ __forceinline__ void transpose_step(float (&v)[N], bool upper) {
#pragma unroll
    for (int j = 0; j < OFF; j++) {
        float send = upper ? v[j] : v[j + OFF];
        float keep = upper ? v[j + OFF] : v[j];
        v[j] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
}

// After it, lane L of the warp holds in v[0] the sum over the warp of every lane's
// v[L % N] (31 shuffles for 32 sums instead of 5 for each; fewer than 32 values: the
// lanes that share L % N add their halves at the end).
template <int N>
__device__ __forceinline__ void transpose_sum(float (&v)[N], int lane) {
    static_assert(N == 8 || N == 16 || N == 32, "8, 16 or 32 values a lane");
    if constexpr (N >= 32) transpose_step<16>(v, lane & 16);
    if constexpr (N >= 16) transpose_step<8>(v, lane & 8);
    transpose_step<4>(v, lane & 4);
    transpose_step<2>(v, lane & 2);
    transpose_step<1>(v, lane & 1);
#pragma unroll
    for (int o = N; o < 32; o <<= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
}

// `KB` keys of the cache from `j0` (zero past `hi`), lane's dimensions `lane + 32t`.
template <typename T, int NT, int KB>
__device__ __forceinline__ void load_keys(const T* base, int row, int j0, int hi, int hd,
                                          int lane, float (&o)[KB][NT]) {
#pragma unroll
    for (int k = 0; k < KB; k++) {
        int j = j0 + k;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            int d = lane + 32 * t;
            o[k][t] = j < hi && d < hd ? to_f32(base[(u64)j * row + d]) : 0.0f;
        }
    }
}

// Causal attention of a tile of rows for the query heads of one KV head that share its
// keys (up to UP (row, head) units; a warp takes KB keys at a time, UP·KB ≤ 32 scores a
// lane: 32 / UP keys, fewer for heads of 512 whose dimensions fill the registers), over
// the `blockIdx.z`-th of `gridDim.z` equal parts of
// the keys the tile sees (split so that a decode step of few rows still keeps every SM
// busy; the parts' partial softmax states are merged by `attention_merge`, or written as
// the result when there is one part). Block (tile, kv head × chunk of `gc` heads, part).
// Each key and value row is read once for all the block's units: the warps take KB keys
// at a time in turn, each with its own online softmax per unit, then merge. Row `i` sees
// keys before `ends[i]` when `ends` is given (bidirectional spans), else up to its own
// position; a window counts back from its own position.
template <typename T, int NT, int UP, int KB>
__device__ void attention_tile(const float* __restrict__ q, float* __restrict__ out,
                               float* part_ml, float* part_acc, const Seg* segs,
                               const int* seg_of_row, const Tile* tiles, const int* ends,
                               int heads, int kv_heads, int hd, int gc, float scale,
                               float cap) {
    // Scores a lane holds before `transpose_sum`; lanes past N repeat lane % N.
    constexpr int N = UP * KB;
    static_assert(N == 8 || N == 16 || N == 32, "UP · KB must be 8, 16 or 32");
    __shared__ float sm[ATTN_WARPS][UP], sl[ATTN_WARPS][UP];
    __shared__ float sacc[ATTN_WARPS][UP * NT * 32];
    Tile tile = tiles[blockIdx.x];
    int group = heads / kv_heads;
    int chunks = (group + gc - 1) / gc;
    int kvh = blockIdx.y / chunks, c = blockIdx.y % chunks;
    int h0 = kvh * group + c * gc;
    int hn = min(gc, group - c * gc);
    int units = tile.n * hn;
    int part = blockIdx.z, parts = gridDim.z;
    Seg s = segs[seg_of_row[tile.row0]];
    int row = kv_heads * hd;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // The keys any row of the tile sees, and this part of them.
    int lo_all = 0x7fffffff, hi_all = 0;
    for (int i = 0; i < tile.n; i++) {
        int r = tile.row0 + i;
        int pos = s.len_before + r - s.row_start;
        int n = ends ? ends[r] : pos + 1;
        int st = s.window > 0 ? max(0, pos - s.window + 1) : 0;
        lo_all = min(lo_all, st);
        hi_all = max(hi_all, n);
    }
    int per = (hi_all - lo_all + parts - 1) / parts;
    int lo = lo_all + part * per, hi = min(hi_all, lo + per);

    // The unit whose score this lane holds after `transpose_sum`, and its key bounds.
    int my_unit = (lane % N) / KB, my_key = lane % KB;
    int my_lo = 0, my_hi = -1;
    if (my_unit < units) {
        int r = tile.row0 + my_unit / hn;
        int pos = s.len_before + r - s.row_start;
        my_hi = ends ? ends[r] : pos + 1;
        my_lo = s.window > 0 ? max(0, pos - s.window + 1) : 0;
    }
    float qv[UP][NT], acc[UP][NT];
#pragma unroll
    for (int u = 0; u < UP; u++) {
        const float* qr = q + (u64)(tile.row0 + u / hn) * heads * hd + (u64)(h0 + u % hn) * hd;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            int d = lane + 32 * t;
            qv[u][t] = u < units && d < hd ? qr[d] : 0.0f;
            acc[u][t] = 0.0f;
        }
    }
    const T* K = (const T*)s.k + kvh * hd;
    const T* V = (const T*)s.v + kvh * hd;
    float m = -WICK_INF, l = 0.0f;  // of `my_unit`, the same in its KB lanes
    for (int j0 = lo + warp * KB; j0 < hi; j0 += ATTN_WARPS * KB) {
        float kr[KB][NT];
        load_keys<T, NT, KB>(K, row, j0, hi, hd, lane, kr);
        float v[N];
#pragma unroll
        for (int u = 0; u < UP; u++)
#pragma unroll
            for (int k = 0; k < KB; k++) {
                float a = 0.0f;
#pragma unroll
                for (int t = 0; t < NT; t++) a = fmaf(qv[u][t], kr[k][t], a);
                v[u * KB + k] = a;
            }
        float vr[KB][NT];
        load_keys<T, NT, KB>(V, row, j0, hi, hd, lane, vr);
        transpose_sum(v, lane);
        int j = j0 + my_key;
        float sc = v[0] * scale;
        if (cap > 0.0f) sc = cap * tanhf(sc / cap);
        if (j >= hi || j < my_lo || j >= my_hi) sc = -WICK_INF;
        float mx = sc;
#pragma unroll
        for (int o = KB / 2; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float mn = fmaxf(m, mx);
        float cf = mn == -WICK_INF ? 1.0f : expf(m - mn);
        float e = sc == -WICK_INF ? 0.0f : expf(sc - mn);
        float es = e;
#pragma unroll
        for (int o = KB / 2; o >= 1; o >>= 1) es += __shfl_xor_sync(0xffffffffu, es, o);
        l = l * cf + es;
        m = mn;
#pragma unroll
        for (int u = 0; u < UP; u++) {
            float cu = __shfl_sync(0xffffffffu, cf, u * KB);
#pragma unroll
            for (int t = 0; t < NT; t++) acc[u][t] *= cu;
#pragma unroll
            for (int k = 0; k < KB; k++) {
                float eu = __shfl_sync(0xffffffffu, e, u * KB + k);
#pragma unroll
                for (int t = 0; t < NT; t++) acc[u][t] = fmaf(eu, vr[k][t], acc[u][t]);
            }
        }
    }
    if (my_key == 0 && lane < N) {
        sm[warp][my_unit] = m;
        sl[warp][my_unit] = l;
    }
#pragma unroll
    for (int u = 0; u < UP; u++)
#pragma unroll
        for (int t = 0; t < NT; t++) sacc[warp][u * NT * 32 + t * 32 + lane] = acc[u][t];
    __syncthreads();
    for (int idx = threadIdx.x; idx < units * hd; idx += blockDim.x) {
        int u = idx / hd, d = idx % hd;
        float M = -WICK_INF;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) M = fmaxf(M, sm[w][u]);
        float L = 0.0f, val = 0.0f;
        if (M != -WICK_INF)
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; w++)
                if (sm[w][u] != -WICK_INF) {
                    float f = expf(sm[w][u] - M);
                    L += sl[w][u] * f;
                    val += sacc[w][u * NT * 32 + d] * f;
                }
        int r = tile.row0 + u / hn, h = h0 + u % hn;
        u64 slot = ((u64)r * heads + h) * parts + part;
        if (parts > 1) {
            part_acc[slot * hd + d] = val;
            if (d == 0) {
                part_ml[2 * slot] = M;
                part_ml[2 * slot + 1] = L;
            }
        } else {
            out[(u64)r * heads * hd + (u64)h * hd + d] = val / L;
        }
    }
}

#define ATTENTION_ENTRY_KB(KV, T, NT, UP, KB)                                                 \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                             \
        attention_##KV##_n##NT##_u##UP(const float* q, float* out, float* part_ml,            \
                                       float* part_acc, const Seg* segs,                      \
                                       const int* seg_of_row, const Tile* tiles,              \
                                       const int* ends, int heads, int kv_heads, int hd,      \
                                       int gc, float scale, float cap) {                      \
        pdl_begin();                                                                          \
        attention_tile<T, NT, UP, KB>(q, out, part_ml, part_acc, segs, seg_of_row, tiles,     \
                                      ends, heads, kv_heads, hd, gc, scale, cap);             \
    }
#define ATTENTION_ENTRY(KV, T, NT, UP) ATTENTION_ENTRY_KB(KV, T, NT, UP, 32 / UP)

ATTENTION_ENTRY(f32, float, 2, 4)
ATTENTION_ENTRY(f32, float, 2, 8)
ATTENTION_ENTRY(f32, float, 2, 16)
ATTENTION_ENTRY(f32, float, 4, 4)
ATTENTION_ENTRY(f32, float, 4, 8)
ATTENTION_ENTRY(f32, float, 4, 16)
ATTENTION_ENTRY(f32, float, 8, 4)
ATTENTION_ENTRY(f32, float, 8, 8)
ATTENTION_ENTRY(f16, F16, 2, 4)
ATTENTION_ENTRY(f16, F16, 2, 8)
ATTENTION_ENTRY(f16, F16, 2, 16)
ATTENTION_ENTRY(f16, F16, 4, 4)
ATTENTION_ENTRY(f16, F16, 4, 8)
ATTENTION_ENTRY(f16, F16, 4, 16)
ATTENTION_ENTRY(f16, F16, 8, 4)
ATTENTION_ENTRY(f16, F16, 8, 8)
// Heads of up to 512 (Gemma 4's full-attention layers): 16 dimensions a lane, so two keys a
// warp at a time keep the registers of four units' queries and sums.
ATTENTION_ENTRY_KB(f32, float, 16, 4, 2)
ATTENTION_ENTRY_KB(f16, F16, 16, 4, 2)

// Merges the parts of `attention` for row `blockIdx.x`, head `blockIdx.y` (at most 32
// parts): the first warp turns the parts' maxima and sums into weights, then every thread
// sums one dimension's parts.
// With `rows` given, block x merges row `rows[x]` (the rows of one kind of segment when a
// pass attends both ways).
extern "C" __global__ void attention_merge(const float* part_ml, const float* part_acc,
                                           float* out, int heads, int hd, int parts,
                                           const int* rows) {
    pdl_begin();
    __shared__ float weight[32];
    int r = rows ? rows[blockIdx.x] : blockIdx.x, h = blockIdx.y;
    u64 base = ((u64)r * heads + h) * parts;
    if (threadIdx.x < 32) {
        int p = threadIdx.x;
        float m = p < parts ? part_ml[2 * (base + p)] : -WICK_INF;
        float l = p < parts ? part_ml[2 * (base + p) + 1] : 0.0f;
        float M = m;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float w = m == -WICK_INF ? 0.0f : expf(m - M);
        float L = warp_sum(l * w);
        weight[p] = w / L;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll 8
        for (int p = 0; p < parts; p++) v = fmaf(part_acc[(base + p) * hd + d], weight[p], v);
        out[(u64)r * heads * hd + h * hd + d] = v;
    }
}

// ---------------------------------------------------------------------------------------
// Flash attention of prompt chunks on the tensor cores (FlashAttention-2's scheme).
//
// A block takes a tile of consecutive rows of one segment for the query heads of one KV
// head (GQA: every head of the group stacked, so a key tile serves them all): BM = 16·WARPS
// (row, head) units, each warp 16 of them. Keys and values stream through shared memory in
// tiles of BN keys (cp.async, two stages: the next tile loads while this one is used); per
// tile a warp makes its 16 × BN scores S = Q·Kᵀ with `mma.sync` m16n8k16 (f16 inputs, f32
// sums), updates each unit's running maximum and sum (online softmax, base 2), turns S into
// probabilities P in the registers that hold it, and adds P·V to its 16 × HD f32
// accumulators, again with m16n8k16. Shared tiles are read with `ldmatrix` (`.trans` for V)
// and padded by 16 bytes a row, so the eight rows of one 8×8 matrix fall in distinct banks.
//
// Queries arrive f32 and are rounded to f16 in shared memory, scaled by the softmax scale
// (and log2 e, unless a soft cap must see the natural score). Keys and values are f16: the
// cache itself when it is f16, else a copy of the keys the chunk sees (`kv_flash_copy`).
// SPLIT (the exact variants) carries each f16 operand the products round as a pair
// hi + lo (lo = f16(x − hi)) and adds the cross products hi·hi + lo·hi + hi·lo, which
// leaves an error of about 2⁻²² of each product instead of 2⁻¹¹: queries and
// probabilities always, keys and values too when they were f32 (KVLO: their remainders
// are copied next to them).
//
// `blockIdx.x` is (KV head, chunk of `gc` heads), `blockIdx.y` a tile (the host lists the
// tiles that see most keys first, and the heads of one tile run side by side), `blockIdx.z`
// one of `gridDim.z` parts of the keys the tile sees (merged by `attention_merge`, or
// normalised here when there is one part). Row `i` sees keys before `ends[i]` when `ends`
// is given, else up to its own position; a window counts back from its own position.

// Where a segment's f16 keys and values are read: `[token][kv_heads][hd]` from token 0
// (a copy may cover only the tokens its chunk sees). `k_lo`, `v_lo`: remainders (KVLO).
struct FlashSeg {
    u64 k;
    u64 v;
    u64 k_lo;
    u64 v_lo;
};

#define FLASH_PAD 8
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// Two floats as f16x2 (`a` in the low half, the first in memory).
__device__ __forceinline__ u32 pack_f16x2(float a, float b) {
    return (u32)f32_to_f16_bits(a) | ((u32)f32_to_f16_bits(b) << 16);
}

// The f16 pair hi + lo of two floats: hi = f16(x), lo = f16(x − hi).
__device__ __forceinline__ void split_f16x2(float a, float b, u32& hi, u32& lo) {
    u16 ha = f32_to_f16_bits(a), hb = f32_to_f16_bits(b);
    hi = (u32)ha | ((u32)hb << 16);
    lo = pack_f16x2(a - to_f32(F16{ha}), b - to_f32(F16{hb}));
}

// Eight floats as f16 (hi) and their remainders (lo), 16 bytes each.
__device__ __forceinline__ void split8(const float* x, uint4& hi, uint4& lo) {
    split_f16x2(x[0], x[1], hi.x, lo.x);
    split_f16x2(x[2], x[3], hi.y, lo.y);
    split_f16x2(x[4], x[5], hi.z, lo.z);
    split_f16x2(x[6], x[7], hi.w, lo.w);
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes from global to shared memory, asynchronously; `bytes` 0 writes zeros and reads
// nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most N of this thread's groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8×8 matrices of 16-bit values: lanes 8i..8i+7 give the row addresses of matrix i,
// register i gets matrix i's row lane/4, columns 2(lane%4) and 2(lane%4)+1 (`.trans`: its
// column lane/4, rows 2(lane%4) and 2(lane%4)+1).
__device__ __forceinline__ void ldsm4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldsm4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// d += a·b for a 16×16 f16 tile a (row-major fragment) and a 16×8 f16 tile b (column
// fragment b0, b1), f32 d.
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// mma16816 with bf16 inputs.
__device__ __forceinline__ void mma16816_bf16(float (&d)[4], const u32 (&a)[4], u32 b0,
                                              u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats rounded to bf16 (`BF`) or f16, the first in the low half (one `cvt` each way,
// compute capability 8.0 and later).
template <bool BF>
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 r = 0;
#if __CUDA_ARCH__ >= 800
    if (BF)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// The routed slots' inputs in expert order, rounded to bf16 (`BF`) or f16, as a dense
// layer's cuBLAS product reads its half copy: row p of `out` is row order[p] / a_div of `a`
// (rows of `in`, a multiple of 4). One block a slot.
template <bool BF>
__device__ void moe_gather_half(const float* __restrict__ a, const int* __restrict__ order,
                                u16* __restrict__ out, int a_div, int in) {
    pdl_begin();
    int p = blockIdx.x;
    const float* src = a + (u64)(order[p] / a_div) * in;
    u16* dst = out + (u64)p * in;
    for (int c = threadIdx.x * 4; c < in; c += blockDim.x * 4) {
        float4 v = *(const float4*)(src + c);
        *(uint2*)(dst + c) = make_uint2(pack_half2<BF>(v.x, v.y), pack_half2<BF>(v.z, v.w));
    }
}

// `moe_grouped` of half weights on the tensor cores, over `moe_gather_half`'s rows `ah` (the
// slots in expert order, so a tile's are consecutive): a block takes a tile's MOE_TM slots
// by MOE2_BN outputs, MOE2_BK inputs a step, both operands copied into shared memory by
// `cp.async` two steps deep (the next step's copies in flight while this one multiplies).
// Four warps, each 16 slots by the MOE2_BN columns: sixteen m16n8k16 products per 16
// inputs, operands read from shared memory as the fragments lay them out (rows padded by 8
// values, so a fragment's 32 lanes hit 32 banks). `in` must be a multiple of 8.
#define MOE2_BN 128
#define MOE2_BK 32
__device__ __forceinline__ void moe_mma_stage(u16 (*as)[MOE2_BK + 8], u16 (*ws)[MOE2_BK + 8],
                                              const u16* __restrict__ ah,
                                              const u16* __restrict__ w, int p0, int len,
                                              int e, int c0, int per, int in, int k0) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int idx = threadIdx.x + 128 * j, m = idx >> 2, c = (idx & 3) * 8;
        bool ok = m < len && k0 + c < in;
        cp_async16(smem_u32(&as[m][c]), ok ? ah + (u64)(p0 + m) * in + k0 + c : ah, ok ? 16 : 0);
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int idx = threadIdx.x + 128 * j, n = idx >> 2, c = (idx & 3) * 8;
        bool ok = c0 + n < per && k0 + c < in;
        cp_async16(smem_u32(&ws[n][c]), ok ? w + ((u64)e * per + c0 + n) * in + k0 + c : w,
                   ok ? 16 : 0);
    }
    cp_async_commit();
}

template <bool BF>
__device__ void moe_grouped_mma(const u16* __restrict__ ah, const int* __restrict__ order,
                                const int* __restrict__ tiles, const int* __restrict__ tiles_n,
                                const u16* __restrict__ w, float* __restrict__ out, int per,
                                int in) {
    __shared__ __align__(16) u16 as[2][MOE_TM][MOE2_BK + 8];
    __shared__ __align__(16) u16 ws[2][MOE2_BN][MOE2_BK + 8];
    pdl_begin();
    int t = blockIdx.x;
    if (t >= tiles_n[0]) return;
    int e = tiles[3 * t], p0 = tiles[3 * t + 1], len = tiles[3 * t + 2];
    int c0 = blockIdx.y * MOE2_BN;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, q = lane & 3;
    float acc[MOE2_BN / 8][4];
#pragma unroll
    for (int n = 0; n < MOE2_BN / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
    int steps = (in + MOE2_BK - 1) / MOE2_BK;
    moe_mma_stage(as[0], ws[0], ah, w, p0, len, e, c0, per, in, 0);
    for (int s = 0; s < steps; s++) {
        if (s + 1 < steps) {
            moe_mma_stage(as[(s + 1) & 1], ws[(s + 1) & 1], ah, w, p0, len, e, c0, per, in,
                          (s + 1) * MOE2_BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        u16 (*a)[MOE2_BK + 8] = as[s & 1];
        u16 (*b)[MOE2_BK + 8] = ws[s & 1];
#pragma unroll
        for (int kk = 0; kk < MOE2_BK; kk += 16) {
            int r = warp * 16 + g;
            u32 af[4] = {*(const u32*)&a[r][kk + 2 * q], *(const u32*)&a[r + 8][kk + 2 * q],
                         *(const u32*)&a[r][kk + 2 * q + 8],
                         *(const u32*)&a[r + 8][kk + 2 * q + 8]};
#pragma unroll
            for (int n = 0; n < MOE2_BN / 8; n++) {
                u32 b0 = *(const u32*)&b[n * 8 + g][kk + 2 * q];
                u32 b1 = *(const u32*)&b[n * 8 + g][kk + 2 * q + 8];
                if (BF)
                    mma16816_bf16(acc[n], af, b0, b1);
                else
                    mma16816(acc[n], af, b0, b1);
            }
        }
        // The stage read here is the one the next step's copies overwrite.
        __syncthreads();
    }
    // Lane (g, q) holds rows g and g + 8 of the warp's 16, columns 2q and 2q + 1 of each
    // 8-column tile.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int m = warp * 16 + g + 8 * h;
        if (m >= len) continue;
        float* o = out + (u64)order[p0 + m] * per;
#pragma unroll
        for (int n = 0; n < MOE2_BN / 8; n++) {
            int c = c0 + n * 8 + 2 * q;
            if (c < per) o[c] = acc[n][2 * h];
            if (c + 1 < per) o[c + 1] = acc[n][2 * h + 1];
        }
    }
}

#define MOE_MMA_ENTRIES(TN, BF)                                                                \
    extern "C" __global__ void moe_gather_##TN(const float* a, const int* order, u16* out,     \
                                               int a_div, int in) {                            \
        moe_gather_half<BF>(a, order, out, a_div, in);                                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128, 3) moe_grouped_mma_##TN(                \
        const u16* ah, const int* order, const int* tiles, const int* tiles_n, const u16* w,   \
        float* out, int per, int in) {                                                         \
        moe_grouped_mma<BF>(ah, order, tiles, tiles_n, w, out, per, in);                       \
    }
MOE_MMA_ENTRIES(f16, false)
MOE_MMA_ENTRIES(bf16, true)

// Copies the keys and values a prompt chunk's flash attention reads out of an f32 cache
// into f16 (`FlashSeg`; with `lo`, the remainders too): segment `todo[blockIdx.y]`, from
// the first key its first row sees to its last row, 16 tokens a block.
extern "C" __global__ void kv_flash_copy(const Seg* segs, const FlashSeg* fsegs, const int* todo,
                                         int row, int lo) {
    pdl_begin();
    int si = todo[blockIdx.y];
    Seg s = segs[si];
    FlashSeg f = fsegs[si];
    int from = s.window > 0 ? max(0, s.len_before - s.window + 1) : 0;
    int end = s.len_before + s.rows;
    int t0 = from + blockIdx.x * 16;
    if (t0 >= end) return;
    u64 a = (u64)t0 * row, b = (u64)min(end, t0 + 16) * row;
    for (u64 i = a + threadIdx.x * 4; i < b; i += blockDim.x * 4) {
        const float* src[2] = {(const float*)s.k + i, (const float*)s.v + i};
        u64 hi_at[2] = {f.k, f.v}, lo_at[2] = {f.k_lo, f.v_lo};
#pragma unroll
        for (int w = 0; w < 2; w++) {
            float4 x = *(const float4*)src[w];
            uint2 h, l;
            split_f16x2(x.x, x.y, h.x, l.x);
            split_f16x2(x.z, x.w, h.y, l.y);
            ((uint2*)((u16*)hi_at[w] + i))[0] = h;
            if (lo) ((uint2*)((u16*)lo_at[w] + i))[0] = l;
        }
    }
}

// The keys unit `u` of a tile sees: [lo, hi) (lo = INT_MAX, hi = 0 past the tile's units).
__device__ __forceinline__ void flash_bounds(int u, int units, int hn, const Tile& tile,
                                             const Seg& s, const int* ends, int& lo, int& hi) {
    if (u >= units) {
        lo = 0x7fffffff;
        hi = 0;
        return;
    }
    int r = tile.row0 + u / hn;
    int pos = s.len_before + r - s.row_start;
    hi = ends ? ends[r] : pos + 1;
    lo = s.window > 0 ? max(0, pos - s.window + 1) : 0;
}

template <int HD, int HDV, int BN, int WARPS, int MT, bool QREG, bool SPLIT, bool KVLO>
__device__ void flash_tile(const float* __restrict__ q, float* __restrict__ out, float* part_ml,
                           float* part_acc, const Seg* segs, const FlashSeg* fsegs,
                           const int* seg_of_row, const Tile* tiles, const int* ends, int heads,
                           int kv_heads, int hd, int gc, float scale, float cap) {
#if __CUDA_ARCH__ >= 800
    // A warp takes MT m-tiles of 16 units, so each key and value fragment it reads from
    // shared memory feeds MT products: with one, shared memory's bandwidth (an `ldmatrix`
    // for every two `mma`s) rather than the tensor cores limits the kernel.
    constexpr int WM = 16 * MT, BM = WM * WARPS, ST = HD + FLASH_PAD, THREADS = 32 * WARPS;
    // Values and outputs: HDV of the HD dimensions a block (heads of 512: two blocks, each
    // making the whole scores and half the outputs, so the accumulators fit the registers).
    constexpr int STV = HDV + FLASH_PAD, DTV = HDV / 8, HALVES = HD / HDV;
    constexpr int NT = BN / 8, DT = HD / 8, TILE = BN * ST, TILEV = BN * STV;
    // A stage: K, V, then (KVLO) their remainders.
    constexpr int PER_STAGE = (KVLO ? 2 : 1) * (TILE + TILEV);
    static_assert(HD % HDV == 0 && HDV % 16 == 0, "value dimensions split evenly");
    static_assert(MT == 1 || !(SPLIT || KVLO), "several m-tiles a warp only for f16 products");
    extern __shared__ uint4 flash_smem[];
    __shared__ int s_lo[WARPS], s_hi[WARPS];
    u16* sQ = (u16*)flash_smem;
    u16* sQlo = sQ + BM * ST;
    u16* sKV = sQ + (SPLIT ? 2 : 1) * BM * ST;

    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, t4 = lane & 3;
    Tile tile = tiles[blockIdx.y];
    int group = heads / kv_heads;
    int chunks = (group + gc - 1) / gc;
    int dv0 = (blockIdx.x % HALVES) * HDV;
    int kc = blockIdx.x / HALVES;
    int kvh = kc / chunks, c = kc % chunks;
    int h0 = kvh * group + c * gc, hn = min(gc, group - c * gc);
    int units = tile.n * hn;
    int si = seg_of_row[tile.row0];
    Seg s = segs[si];
    FlashSeg f = fsegs[si];
    int row = kv_heads * hd;

    // This thread's units (rows g and g + 8 of each of its warp's m-tiles: unit
    // ub + 16t + 8r for m-tile t, half r) and the keys each sees.
    int ub = warp * WM + g;
    int lo[MT][2], hi[MT][2];
    int wlo = 0x7fffffff, whi = 0;
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            flash_bounds(ub + 16 * t + 8 * r, units, hn, tile, s, ends, lo[t][r], hi[t][r]);
            wlo = min(wlo, lo[t][r]);
            whi = max(whi, hi[t][r]);
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wlo = min(wlo, __shfl_xor_sync(0xffffffffu, wlo, o));
        whi = max(whi, __shfl_xor_sync(0xffffffffu, whi, o));
    }
    if (lane == 0) {
        s_lo[warp] = wlo;
        s_hi[warp] = whi;
    }

    // The queries, scaled and rounded to f16 (and their remainders).
    float qscale = cap > 0.0f ? scale : scale * LOG2E;
    for (int i = threadIdx.x; i < BM * DT; i += THREADS) {
        int u = i / DT, d = (i % DT) * 8;
        float x[8];
        if (u < units && d < hd) {
            const float* src =
                q + (u64)(tile.row0 + u / hn) * heads * hd + (u64)(h0 + u % hn) * hd + d;
            load8(src, x);
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] *= qscale;
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] = 0.0f;
        }
        uint4 hi8, lo8;
        split8(x, hi8, lo8);
        *(uint4*)(sQ + u * ST + d) = hi8;
        if (SPLIT) *(uint4*)(sQlo + u * ST + d) = lo8;
    }
    __syncthreads();

    // The keys of the block, and this part of them (whole key tiles).
    int lo_all = 0x7fffffff, hi_all = 0;
#pragma unroll
    for (int w = 0; w < WARPS; w++) {
        lo_all = min(lo_all, s_lo[w]);
        hi_all = max(hi_all, s_hi[w]);
    }
    int parts = gridDim.z, part = blockIdx.z;
    int span = max(0, hi_all - lo_all);
    int per = ((span + parts - 1) / parts + BN - 1) / BN * BN;
    int klo = lo_all + part * per, khi = min(hi_all, klo + per);
    int ntiles = khi > klo ? (khi - klo + BN - 1) / BN : 0;
    // Keys past the part are another block's. The warp's keys, and those every one of
    // its (real) units sees.
    int wmax_lo = -0x7fffffff, wmin_hi = 0x7fffffff;
    whi = 0;
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            hi[t][r] = min(hi[t][r], khi);
            if (ub + 16 * t + 8 * r < units) {
                wmax_lo = max(wmax_lo, lo[t][r]);
                wmin_hi = min(wmin_hi, hi[t][r]);
            }
            whi = max(whi, hi[t][r]);
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wmax_lo = max(wmax_lo, __shfl_xor_sync(0xffffffffu, wmax_lo, o));
        wmin_hi = min(wmin_hi, __shfl_xor_sync(0xffffffffu, wmin_hi, o));
        whi = max(whi, __shfl_xor_sync(0xffffffffu, whi, o));
    }

    // Loads key tile j0 (keys from j0, zeros past the part and past hd; values of this
    // block's dimensions) into stage `st`.
    const u16* Kg = (const u16*)f.k + kvh * hd;
    const u16* Vg = (const u16*)f.v + kvh * hd;
    const u16* Klg = (const u16*)f.k_lo + kvh * hd;
    const u16* Vlg = (const u16*)f.v_lo + kvh * hd;
    auto load_tile = [&](int st, int j0) {
        u32 base = smem_u32(sKV + st * PER_STAGE);
        for (int i = threadIdx.x; i < BN * DT; i += THREADS) {
            int jj = i / DT, d = (i % DT) * 8;
            int j = j0 + jj;
            bool ok = j < khi && d < hd;
            u64 off = ok ? (u64)j * row + d : 0;
            int bytes = ok ? 16 : 0;
            u32 dst = base + (u32)(jj * ST + d) * 2;
            cp_async16(dst, Kg + off, bytes);
            if (KVLO) cp_async16(dst + (TILE + TILEV) * 2, Klg + off, bytes);
        }
        for (int i = threadIdx.x; i < BN * DTV; i += THREADS) {
            int jj = i / DTV, d = (i % DTV) * 8;
            int j = j0 + jj;
            bool ok = j < khi && dv0 + d < hd;
            u64 off = ok ? (u64)j * row + dv0 + d : 0;
            int bytes = ok ? 16 : 0;
            u32 dst = base + (u32)(TILE + jj * STV + d) * 2;
            cp_async16(dst, Vg + off, bytes);
            if (KVLO) cp_async16(dst + (TILE + TILEV) * 2, Vlg + off, bytes);
        }
    };

    // Query fragments kept in registers (QREG), else read from shared memory each tile;
    // m-tile t's start 16t rows further.
    constexpr int QT = QREG ? MT : 1, QK = QREG ? HD / 16 : 1, QLK = QREG && SPLIT ? HD / 16 : 1;
    u32 qf[QT][QK][4], qlf[QLK][4];
    u32 q_addr = smem_u32(sQ + (warp * WM + (lane & 15)) * ST + (lane >> 4) * 8);
    u32 ql_addr = q_addr + BM * ST * 2;
    constexpr u32 Q_MTILE = 16 * ST * 2;
    if (QREG) {
#pragma unroll
        for (int kk = 0; kk < (QREG ? HD / 16 : 0); kk++) {
#pragma unroll
            for (int t = 0; t < QT; t++) ldsm4(qf[t][QREG ? kk : 0], q_addr + t * Q_MTILE + kk * 32);
            if (SPLIT) ldsm4(qlf[QREG && SPLIT ? kk : 0], ql_addr + kk * 32);
        }
    }

    float o[MT][DTV][4];
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int n = 0; n < DTV; n++) o[t][n][0] = o[t][n][1] = o[t][n][2] = o[t][n][3] = 0.0f;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int t = 0; t < MT; t++) {
        m[t][0] = m[t][1] = -WICK_INF;
        l[t][0] = l[t][1] = 0.0f;
    }
    // Lane offsets of ldmatrix rows: K (non-transposed: keys by lane/16, dims by lane/8 % 2)
    // and V (transposed: keys by lane/8 % 2, dims by lane/16), in bytes.
    u32 k_off = (u32)(((lane & 7) + ((lane >> 4) << 3)) * ST + (((lane >> 3) & 1) << 3)) * 2;
    u32 v_off = (u32)(((lane & 7) + (((lane >> 3) & 1) << 3)) * STV + ((lane >> 4) << 3)) * 2;
    float cap2 = cap * LOG2E, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;

    if (ntiles > 0) load_tile(0, klo);
    cp_async_commit();
    for (int it = 0; it < ntiles; it++) {
        int j0 = klo + it * BN;
        if (it + 1 < ntiles) load_tile((it + 1) & 1, j0 + BN);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        u32 sk = smem_u32(sKV + (it & 1) * PER_STAGE);
        u32 sv = sk + TILE * 2;
        if (j0 < whi && j0 + BN > wlo) {
            // S = Q·Kᵀ: per m-tile 16 units × BN keys, n-tile n holding keys
            // j0 + 8n + 2·t4 + {0, 1} of rows g (elements 0, 1) and g + 8 (2, 3).
            float sc[MT][NT][4];
#pragma unroll
            for (int t = 0; t < MT; t++)
#pragma unroll
                for (int n = 0; n < NT; n++)
                    sc[t][n][0] = sc[t][n][1] = sc[t][n][2] = sc[t][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                u32 a[MT][4], al[4];
#pragma unroll
                for (int t = 0; t < MT; t++) {
                    if (QREG) {
#pragma unroll
                        for (int x = 0; x < 4; x++) a[t][x] = qf[QREG ? t : 0][QREG ? kk : 0][x];
                    } else {
                        ldsm4(a[t], q_addr + t * Q_MTILE + kk * 32);
                    }
                }
                if (SPLIT) {
                    if (QREG) {
#pragma unroll
                        for (int x = 0; x < 4; x++) al[x] = qlf[QREG && SPLIT ? kk : 0][x];
                    } else {
                        ldsm4(al, ql_addr + kk * 32);
                    }
                }
#pragma unroll
                for (int nn = 0; nn < BN / 16; nn++) {
                    u32 b[4];
                    u32 at = sk + (u32)(nn * 16 * ST + kk * 16) * 2 + k_off;
                    ldsm4(b, at);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        mma16816(sc[t][2 * nn], a[t], b[0], b[1]);
                        mma16816(sc[t][2 * nn + 1], a[t], b[2], b[3]);
                    }
                    if (SPLIT) {
                        mma16816(sc[0][2 * nn], al, b[0], b[1]);
                        mma16816(sc[0][2 * nn + 1], al, b[2], b[3]);
                    }
                    if (KVLO) {
                        ldsm4(b, at + (TILE + TILEV) * 2);
                        mma16816(sc[0][2 * nn], a[0], b[0], b[1]);
                        mma16816(sc[0][2 * nn + 1], a[0], b[2], b[3]);
                    }
                }
            }
            if (cap > 0.0f) {
#pragma unroll
                for (int t = 0; t < MT; t++)
#pragma unroll
                    for (int n = 0; n < NT; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            sc[t][n][e] = cap2 * tanhf(sc[t][n][e] * inv_cap);
            }
            if (!(j0 >= wmax_lo && j0 + BN <= wmin_hi)) {
#pragma unroll
                for (int t = 0; t < MT; t++)
#pragma unroll
                    for (int n = 0; n < NT; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            int j = j0 + 8 * n + 2 * t4 + (e & 1);
                            if (!(j >= lo[t][e >> 1] && j < hi[t][e >> 1])) sc[t][n][e] = -WICK_INF;
                        }
            }
            // Online softmax (base 2) of each m-tile's rows g and g + 8, shared by the
            // lane's quad.
#pragma unroll
            for (int t = 0; t < MT; t++) {
                float mx0 = m[t][0], mx1 = m[t][1];
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    mx0 = fmaxf(mx0, fmaxf(sc[t][n][0], sc[t][n][1]));
                    mx1 = fmaxf(mx1, fmaxf(sc[t][n][2], sc[t][n][3]));
                }
#pragma unroll
                for (int o2 = 1; o2 <= 2; o2 <<= 1) {
                    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
                    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
                }
                float b0 = mx0 == -WICK_INF ? 0.0f : mx0, b1 = mx1 == -WICK_INF ? 0.0f : mx1;
                float cf0 = exp2f(m[t][0] - b0), cf1 = exp2f(m[t][1] - b1);
                m[t][0] = mx0;
                m[t][1] = mx1;
                float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    sc[t][n][0] = exp2f(sc[t][n][0] - b0);
                    sc[t][n][1] = exp2f(sc[t][n][1] - b0);
                    sc[t][n][2] = exp2f(sc[t][n][2] - b1);
                    sc[t][n][3] = exp2f(sc[t][n][3] - b1);
                    ls0 += sc[t][n][0] + sc[t][n][1];
                    ls1 += sc[t][n][2] + sc[t][n][3];
                }
                l[t][0] = l[t][0] * cf0 + ls0;
                l[t][1] = l[t][1] * cf1 + ls1;
#pragma unroll
                for (int n = 0; n < DTV; n++) {
                    o[t][n][0] *= cf0;
                    o[t][n][1] *= cf0;
                    o[t][n][2] *= cf1;
                    o[t][n][3] *= cf1;
                }
            }
            // O += P·V: the scores' registers are P's row-major fragments (keys 16kk..).
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                u32 a[MT][4], al[4];
#pragma unroll
                for (int t = 0; t < MT; t++) {
                    split_f16x2(sc[t][2 * kk][0], sc[t][2 * kk][1], a[t][0], al[0]);
                    split_f16x2(sc[t][2 * kk][2], sc[t][2 * kk][3], a[t][1], al[1]);
                    split_f16x2(sc[t][2 * kk + 1][0], sc[t][2 * kk + 1][1], a[t][2], al[2]);
                    split_f16x2(sc[t][2 * kk + 1][2], sc[t][2 * kk + 1][3], a[t][3], al[3]);
                }
#pragma unroll
                for (int nn = 0; nn < HDV / 16; nn++) {
                    u32 b[4];
                    u32 at = sv + (u32)(kk * 16 * STV + nn * 16) * 2 + v_off;
                    ldsm4_t(b, at);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        mma16816(o[t][2 * nn], a[t], b[0], b[1]);
                        mma16816(o[t][2 * nn + 1], a[t], b[2], b[3]);
                    }
                    if (SPLIT) {
                        mma16816(o[0][2 * nn], al, b[0], b[1]);
                        mma16816(o[0][2 * nn + 1], al, b[2], b[3]);
                    }
                    if (KVLO) {
                        ldsm4_t(b, at + (TILE + TILEV) * 2);
                        mma16816(o[0][2 * nn], a[0], b[0], b[1]);
                        mma16816(o[0][2 * nn + 1], a[0], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int t = 0; t < MT; t++) {
        // Each lane summed its own columns: the quad's sums are the rows'.
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            l[t][0] += __shfl_xor_sync(0xffffffffu, l[t][0], o2);
            l[t][1] += __shfl_xor_sync(0xffffffffu, l[t][1], o2);
        }
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int u = ub + 16 * t + 8 * half;
            if (u >= units) continue;
            float mu = m[t][half], lu = l[t][half];
            int r = tile.row0 + u / hn, h = h0 + u % hn;
            u64 slot = ((u64)r * heads + h) * parts + part;
            float* dst = parts > 1 ? part_acc + slot * hd : out + ((u64)r * heads + h) * hd;
            float inv = parts > 1 ? 1.0f : 1.0f / lu;
#pragma unroll
            for (int n = 0; n < DTV; n++) {
                int d = dv0 + 8 * n + 2 * t4;
                if (d < hd) {
                    float2 v;
                    v.x = o[t][n][2 * half] * inv;
                    v.y = o[t][n][2 * half + 1] * inv;
                    *(float2*)(dst + d) = v;
                }
            }
            if (parts > 1 && t4 == 0 && dv0 == 0) {
                part_ml[2 * slot] = mu == -WICK_INF ? -WICK_INF : mu * LN2;
                part_ml[2 * slot + 1] = lu;
            }
        }
    }
#endif
}

// Shared memory of a flash kernel (the host's `FlashKernel::shared_bytes` is the same sum).
#define FLASH_SHARED(HD, HDV, BN, WARPS, MT, SPLIT, KVLO)                                  \
    ((16 * (WARPS) * (MT) * ((SPLIT) ? 2 : 1) * ((HD) + FLASH_PAD) +                       \
      2 * (BN) * ((KVLO) ? 2 : 1) * ((HD) + (HDV) + 2 * FLASH_PAD)) * 2)

#define FLASH_ENTRY(NAME, HD, BN, WARPS, QREG, SPLIT, KVLO)                                    \
    FLASH_ENTRY_V(NAME, HD, HD, BN, WARPS, 1, QREG, SPLIT, KVLO)
#define FLASH_ENTRY_V(NAME, HD, HDV, BN, WARPS, MT, QREG, SPLIT, KVLO)                         \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                  \
        NAME(const float* q, float* out, float* part_ml, float* part_acc, const Seg* segs,    \
             const FlashSeg* fsegs, const int* seg_of_row, const Tile* tiles,                \
             const int* ends, int heads, int kv_heads, int hd, int gc, float scale,          \
             float cap) {                                                                    \
        pdl_begin();                                                                          \
        flash_tile<HD, HDV, BN, WARPS, MT, QREG, SPLIT, KVLO>(q, out, part_ml, part_acc,      \
                                                              segs, fsegs, seg_of_row, tiles, \
                                                              ends, heads, kv_heads, hd, gc,  \
                                                              scale, cap);                    \
    }

// name, HD, BN, WARPS, QREG, SPLIT, KVLO (the host's `FlashKernel` table repeats these)
FLASH_ENTRY(flash_fast_d64, 64, 64, 4, true, false, false)
FLASH_ENTRY(flash_fast_d128, 128, 64, 4, true, false, false)
FLASH_ENTRY(flash_fast_d256, 256, 32, 4, false, false, false)
FLASH_ENTRY(flash_exact_d64, 64, 64, 4, true, true, false)
FLASH_ENTRY(flash_exact_d128, 128, 64, 4, false, true, false)
FLASH_ENTRY(flash_exact_d256, 256, 32, 4, false, true, false)
FLASH_ENTRY(flash_exact_lo_d64, 64, 64, 4, false, true, true)
FLASH_ENTRY(flash_exact_lo_d128, 128, 32, 4, false, true, true)
FLASH_ENTRY(flash_exact_lo_d256, 256, 16, 4, false, true, true)
// Heads of 512 (Gemma 4's full-attention layers): two blocks a tile, each with the whole
// scores and 256 of the output dimensions (name, HD, HDV, BN, WARPS, MT, QREG, SPLIT, KVLO).
// The exact kernel of f32 caches takes 32 units a block to stay within Hopper's 227 KB.
FLASH_ENTRY_V(flash_fast_d512, 512, 256, 32, 4, 1, false, false, false)
FLASH_ENTRY_V(flash_exact_d512, 512, 256, 16, 4, 1, false, true, false)
FLASH_ENTRY_V(flash_exact_lo_d512, 512, 256, 16, 2, 1, false, true, true)
// Two m-tiles a warp (128 units a block) for prompt chunks of many rows, f16 products
// (name, HD, HDV, BN, WARPS, MT, QREG, SPLIT, KVLO).
FLASH_ENTRY_V(flash_fast_d64_m2, 64, 64, 64, 4, 2, true, false, false)
FLASH_ENTRY_V(flash_fast_d128_m2, 128, 128, 64, 4, 2, false, false, false)

// ---------------------------------------------------------------------------------------
// Argmax of each row (the first maximum), with an optional token mask per row: `mask_at[r]`
// is the offset of row r's words in `masks` (-1: unmasked); token t is allowed when bit
// t % 32 of word t / 32 is set (ids past `words` words are not). Two stages: block
// (r, p) finds the maximum of the p-th of `gridDim.y` slices of row r into `part`, then
// `argmax_finish` picks among a row's slices.
__device__ __forceinline__ void better(float& best, int& bi, float v, int i) {
    if (v > best || (v == best && i < bi)) {
        best = v;
        bi = i;
    }
}

__device__ void block_argmax(float& best, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        better(best, bi, ov, oi);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int nw = (blockDim.x + 31) >> 5;
        for (int w = 1; w < nw; w++) better(best, bi, sv[w], si[w]);
    }
}

extern "C" __global__ void argmax_rows(const float* __restrict__ x, float* part, int vocab,
                                       const u32* masks, const int* mask_at, int words) {
    pdl_begin();
    int r = blockIdx.x, p = blockIdx.y, parts = gridDim.y;
    int per = (vocab + parts - 1) / parts;
    int lo = p * per, hi = min(vocab, lo + per);
    const float* row = x + (u64)r * vocab;
    int at = mask_at ? mask_at[r] : -1;
    float best = -WICK_INF;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = row[i];
        if (at >= 0) {
            int wi = i >> 5;
            u32 bits = wi < words ? masks[at + wi] : 0u;
            if (((bits >> (i & 31)) & 1u) == 0u) v = -WICK_INF;
        }
        better(best, bi, v, i);
    }
    block_argmax(best, bi);
    if (threadIdx.x == 0) {
        part[2 * ((u64)r * parts + p)] = best;
        part[2 * ((u64)r * parts + p) + 1] = __int_as_float(bi);
    }
}

extern "C" __global__ void argmax_finish(const float* part, u32* out, int parts) {
    pdl_begin();
    int r = blockIdx.x;
    float best = -WICK_INF;
    int bi = 0x7fffffff;
    for (int p = threadIdx.x; p < parts; p += blockDim.x)
        better(best, bi, part[2 * ((u64)r * parts + p)],
               __float_as_int(part[2 * ((u64)r * parts + p) + 1]));
    block_argmax(best, bi);
    if (threadIdx.x == 0) out[r] = bi == 0x7fffffff ? 0u : (u32)bi;
}

// ---------------------------------------------------------------------------------------
// LayerNorm and an ungated activation (vision towers: Qwen 3.5's, SigLIP; StarCoder 2)

// LayerNorm of each `n`-long group, one block per group: the mean, then the variance of
// the centred values (two sums, as the host computes them), then (x - mean) / sqrt(var +
// eps) · w + b (`b` may be null). Each thread keeps up to NORM_CACHE values in registers.
extern "C" __global__ void layer_norm(const float* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ b, float* __restrict__ out,
                                      int n, float eps) {
    pdl_begin();
    u64 base = (u64)blockIdx.x * n;
    float v[NORM_CACHE];
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        v[c] = i < n ? x[base + i] : 0.0f;
        s += v[c];
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x)
        s += x[base + i];
    float mean = block_sum(s) / (float)n;
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        float d = v[c] - mean;
        if (i < n) ss = fmaf(d, d, ss);
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x) {
        float d = x[base + i] - mean;
        ss = fmaf(d, d, ss);
    }
    float inv = 1.0f / sqrtf(block_sum(ss) / (float)n + eps);
#pragma unroll
    for (int c = 0; c < NORM_CACHE; c++) {
        int i = threadIdx.x + c * blockDim.x;
        if (i < n) out[base + i] = (v[c] - mean) * inv * w[i] + (b ? b[i] : 0.0f);
    }
    for (int i = threadIdx.x + NORM_CACHE * blockDim.x; i < n; i += blockDim.x)
        out[base + i] = (x[base + i] - mean) * inv * w[i] + (b ? b[i] : 0.0f);
}

// out = act(x) (kind as `glu`'s: 0 SiLU, 1 GELU tanh).
extern "C" __global__ void activation(const float* x, float* out, int kind, long long n) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = act(x[i], kind);
}

// ---------------------------------------------------------------------------------------
// Affine products of 3 to 256 rows on the tensor cores, dequantizing in registers
//
// `mma.sync` m16n8k16 with f16 inputs and f32 sums. A block of QM_WARPS warps takes a tile
// of 16·MT rows of x (blockIdx.z) by QM_COLS outputs (blockIdx.x; with GLU, QM_COLS / 2
// gate rows and their up rows) over one of `gridDim.y` slices of the inputs. Slabs of
// QM_SLAB inputs of x are rounded to f16 into shared memory, then every warp streams its
// 16 weight rows over the slab: per mma step each lane dequantizes its own 16-byte loads
// (one group each) with f16x2 arithmetic into the B fragment, so each weight byte is read
// once per row tile and never written back.
//
// The dot product's order of inputs is free, so each lane takes contiguous packed bytes:
// lane (g = lane/4, t = lane%4) holds weight row g's values QC·t .. QC·t + QC of a chunk
// of 4·QC inputs, and its k-slots of step s are those four values that one u32 of packed
// bytes unpacks into (8 bits: bytes 4s..4s+3 in order; 4 bits: the even or odd nibbles of
// word s/2). x is stored in that order (4 bits: each 8 inputs as 0,2,4,6,1,3,5,7), so the
// matching A fragment is one 8-byte shared load per row.
//
// x is scaled by 2⁻⁸ and the weights by 2⁸ (exact), so f16 holds activations up to about
// 1.7·10⁷ and scales down to about 2.4·10⁻¹⁰ stay normal. A product with one slice stores
// y (+ bias); with more, and always with GLU (the activation inline spills registers), raw
// sums go to `part[slice][row][col]` and `affine_mma_finish` adds them up.

#define QM_WARPS 4
#define QM_COLS (QM_WARPS * 16)
#define QM_SLAB 256
// Row stride of the shared x tile in halves: 4 halves of padding put the rows of one
// 8-byte fragment load in distinct banks.
#define QM_STRIDE (QM_SLAB + 4)
#define QM_SCALE 256.0f
// Blocks an SM must fit (ptxas keeps the registers to 128 a thread, which the 64-row
// tiles need without spilling).
#define QM_MIN_BLOCKS 4

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Two bytes of `v` (selector `sel` picks them into the low byte of each half) as the f16
// pair s·q + b (s2, b2: the scale and bias in both halves).
__device__ __forceinline__ u32 dequant_pair(u32 v, u32 sel, u32 s2, u32 b2) {
    // 0x64 above a byte is the f16 1024 + q, exactly; less 1024 is q.
    u32 q = hsub2(__byte_perm(v, 0x64646464u, sel), 0x64006400u);
    return hfma2(q, s2, b2);
}

// NC chunks of a slab's weights as one lane of `affine_mma` / `affine_mmx` holds them: its
// packed 16-byte loads and, per load, the scale and bias as f16 pairs (×2⁸).
template <int NC>
struct AffinePart {
    uint4 p[NC][2];
    u32 s2[NC][2], b2[NC][2];
};

// Issues this lane's loads (rows `wrow`, lane column t) of the NC chunks from input k0.
template <typename S, int BITS, int NC>
__device__ __forceinline__ void affine_load(AffinePart<NC>& pt, const u8* __restrict__ w,
                                         const S* __restrict__ scales,
                                         const S* __restrict__ biases, const int (&wrow)[2],
                                         u64 row_bytes, int groups, int in, int group, int k0,
                                         int t) {
    const int QC = 128 / BITS, CH = 4 * QC;
#pragma unroll
    for (int ch = 0; ch < NC; ch++) {
        int k = k0 + ch * CH + QC * t;
        bool live = k < in;
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            float sc = 0.0f, bi = 0.0f;
            pt.p[ch][nt].x = pt.p[ch][nt].y = pt.p[ch][nt].z = pt.p[ch][nt].w = 0u;
            if (live) {
                pt.p[ch][nt] = *(const uint4*)(w + wrow[nt] * row_bytes + (u64)k * BITS / 8);
                u64 gi = (u64)wrow[nt] * groups + k / group;
                sc = to_f32(scales[gi]) * QM_SCALE;
                bi = to_f32(biases[gi]) * QM_SCALE;
            }
            pt.s2[ch][nt] = pack_f16x2(sc, sc);
            pt.b2[ch][nt] = pack_f16x2(bi, bi);
        }
    }
}

// acc += the x tile (`xs`, 16·MT rows, or 8 with MT = 0, from slab column c0) times the
// lane's NC chunks of weights. acc[mt][nt][i]: row 16·mt + g (+8 for i ≥ 2) of x, column
// 2t + (i & 1) of weight tile nt; with MT = 0, acc[0][0][i]: row 2t + (i & 1) of x, weight
// row g of tile i / 2.
template <int BITS, int MT, int NC>
__device__ __forceinline__ void affine_mul(const AffinePart<NC>& pt, const u16* xs, int c0,
                                        float (&acc)[MT > 0 ? MT : 1][2][4], int g, int t) {
    const int QC = 128 / BITS, CH = 4 * QC, STEPS = QC / 4;
#pragma unroll
    for (int ch = 0; ch < NC; ch++) {
        int c = c0 + ch * CH;
#pragma unroll
        for (int s = 0; s < STEPS; s++) {
            u32 bf[2][2];
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                u32 word[4] = {pt.p[ch][nt].x, pt.p[ch][nt].y, pt.p[ch][nt].z, pt.p[ch][nt].w};
                u32 v;
                if (BITS == 8) {
                    v = word[s];
                } else {
                    v = (s & 1) ? (word[s >> 1] >> 4) & 0x0f0f0f0fu : word[s >> 1] & 0x0f0f0f0fu;
                }
                bf[nt][0] = dequant_pair(v, 0x4140, pt.s2[ch][nt], pt.b2[ch][nt]);
                bf[nt][1] = dequant_pair(v, 0x4342, pt.s2[ch][nt], pt.b2[ch][nt]);
            }
            if (MT == 0) {
                // Eight rows of x: the weights' 16 rows are A, x's rows B.
                uint2 xr = *(const uint2*)&xs[g * QM_STRIDE + c + QC * t + 4 * s];
                u32 a[4] = {bf[0][0], bf[1][0], bf[0][1], bf[1][1]};
                mma16816(acc[0][0], a, xr.x, xr.y);
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                int col = c + QC * t + 4 * s;
                uint2 top = *(const uint2*)&xs[(16 * mt + g) * QM_STRIDE + col];
                uint2 bot = *(const uint2*)&xs[(16 * mt + g + 8) * QM_STRIDE + col];
                u32 a[4] = {top.x, bot.x, top.y, bot.y};
#pragma unroll
                for (int nt = 0; nt < 2; nt++) mma16816(acc[mt][nt], a, bf[nt][0], bf[nt][1]);
            }
        }
    }
}

template <typename S, int BITS, int MT, bool GLU>
__device__ void affine_mma(const float* __restrict__ x, const u8* __restrict__ w,
                           const S* __restrict__ scales, const S* __restrict__ biases,
                           const float* __restrict__ bias, float* __restrict__ y,
                           float* __restrict__ part, int rows, int in, int out, int group) {
    const int CH = 4 * (128 / BITS);  // inputs per chunk (one 16-byte load per lane)
    __shared__ __align__(16) u16 xs[16 * MT][QM_STRIDE];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // `out` is the outputs (GLU: the width, units of a gate and an up row).
    int o = blockIdx.x * (GLU ? QM_COLS / 2 : QM_COLS);
    int r0 = blockIdx.z * 16 * MT;
    u64 row_bytes = (u64)in * BITS / 8;
    int groups = in / group;
    // This lane's two weight rows (clamped: rows past the end are read, never stored).
    int wrow[2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        int u = GLU ? o + 8 * warp + g : o + 16 * warp + 8 * nt + g;
        u = min(u, out - 1);
        wrow[nt] = GLU && nt == 1 ? out + u : u;
    }
    int slabs = (in + QM_SLAB - 1) / QM_SLAB;
    int per = (slabs + gridDim.y - 1) / gridDim.y;
    int s0 = blockIdx.y * per, s1 = min(slabs, s0 + per);
    float acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][nt][i] = 0.0f;
    pdl_launch();
    pdl_wait();
    for (int sl = s0; sl < s1; sl++) {
        int k0 = sl * QM_SLAB;
        __syncthreads();
        // x's slab as f16 · 2⁻⁸, in the lanes' order (zeros past the rows and inputs).
        for (int it = threadIdx.x; it < 16 * MT * (QM_SLAB / 8); it += QM_WARPS * 32) {
            int r = it / (QM_SLAB / 8), c = (it % (QM_SLAB / 8)) * 8;
            float v[8];
            if (r0 + r < rows && k0 + c < in) {
                load8(x + (u64)(r0 + r) * in + k0 + c, v);
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) v[i] = 0.0f;
            }
            const float f = 1.0f / QM_SCALE;
            uint2 lo, hi;
            if (BITS == 8) {
                lo.x = pack_f16x2(v[0] * f, v[1] * f);
                lo.y = pack_f16x2(v[2] * f, v[3] * f);
                hi.x = pack_f16x2(v[4] * f, v[5] * f);
                hi.y = pack_f16x2(v[6] * f, v[7] * f);
            } else {
                lo.x = pack_f16x2(v[0] * f, v[2] * f);
                lo.y = pack_f16x2(v[4] * f, v[6] * f);
                hi.x = pack_f16x2(v[1] * f, v[3] * f);
                hi.y = pack_f16x2(v[5] * f, v[7] * f);
            }
            *(uint2*)&xs[r][c] = lo;
            *(uint2*)&xs[r][c + 4] = hi;
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < QM_SLAB; c += CH) {
            AffinePart<1> pt;
            affine_load<S, BITS, 1>(pt, w, scales, biases, wrow, row_bytes, groups, in, group,
                                    k0 + c, t);
            affine_mul<BITS, MT, 1>(pt, &xs[0][0], c, acc, g, t);
        }
    }
    // acc[mt][nt][i]: row 16·mt + g (+8 for i ≥ 2), column 2t + (i & 1) of tile nt.
    int cols = GLU ? 2 * out : out;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = r0 + 16 * mt + g + (i >= 2 ? 8 : 0);
            if (r >= rows) continue;
            int col = 2 * t + (i & 1);
            if (GLU) {
                int u = o + 8 * warp + col;
                if (u >= out) continue;
                float* pr = part + ((u64)blockIdx.y * rows + r) * cols;
                pr[u] = acc[mt][0][i];
                pr[out + u] = acc[mt][1][i];
            } else {
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    int u = o + 16 * warp + 8 * nt + col;
                    if (u >= out) continue;
                    if (gridDim.y == 1)
                        y[(u64)r * out + u] = acc[mt][nt][i] + (bias ? bias[u] : 0.0f);
                    else
                        part[((u64)blockIdx.y * rows + r) * cols + u] = acc[mt][nt][i];
                }
            }
        }
}

// Sums the `slices` partial products of `affine_mma`: y = Σ + bias, or with `glu` ≥ 0 (an
// activation kind; `out` the width) act(Σ gate)·Σ up.
extern "C" __global__ void affine_mma_finish(const float* __restrict__ part,
                                             const float* __restrict__ bias,
                                             float* __restrict__ y, int rows, int out,
                                             int slices, int glu) {
    pdl_begin();
    int cols = glu >= 0 ? 2 * out : out;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)rows * out;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / out;
        int u = (int)(i - r * out);
        float a = 0.0f, b = 0.0f;
        for (int z = 0; z < slices; z++) {
            const float* pr = part + ((u64)z * rows + r) * cols;
            a += pr[u];
            if (glu >= 0) b += pr[out + u];
        }
        y[i] = glu >= 0 ? act(a, glu) * b : a + (bias ? bias[u] : 0.0f);
    }
}

// ---------------------------------------------------------------------------------------
// The same products with x rounded once (`affine_mmx_*`, `WICK_CUDA_QUANT_MMA=once`)
//
// `affine_mma` rounds x's slabs to f16 in every block, from f32: each block of QM_COLS
// outputs reads the whole tile of x again, at 4 bytes a value, while the weights it reads
// are 1 byte (8 bits) or half a byte a value; for the fused gate/up matrix of an 8B model at
// 64 rows that is about 4 times the weights' bytes, read between two barriers while no
// weight load is in flight. Here `affine_mmx_x` rounds x once per product into the lanes'
// order (f16 · 2⁻⁸, rows and inputs padded with zeros), and a block of QX_WARPS warps
// (twice the outputs, so each x byte serves twice the weights) copies its slabs into two
// shared-memory buffers by `cp.async` while the slab before is multiplied; each slab's
// weight loads are issued before the block waits for its x. Each product rounds and
// multiplies as `affine_mma` does; only the number of input slices whose sums are added
// (and so the order of that addition) may differ.

#define QX_WARPS 8
#define QX_COLS (QX_WARPS * 16)
// Blocks an SM must fit (ptxas keeps the registers to 128 a thread).
#define QX_MIN_BLOCKS 2

// x (rows × in, f32) rounded for `affine_mmx_*`: `rows_pad` rows of `in_pad` halves.
extern "C" __global__ void affine_mmx_x(const float* __restrict__ x, u16* __restrict__ xh,
                                        int rows, int in, int rows_pad, int in_pad, int bits) {
    pdl_begin();
    int per = in_pad / 8;
    for (long long it = blockIdx.x * (long long)blockDim.x + threadIdx.x;
         it < (long long)rows_pad * per; it += (long long)gridDim.x * blockDim.x) {
        int r = (int)(it / per), c = (int)(it - (long long)r * per) * 8;
        float v[8];
        if (r < rows && c < in) {
            load8(x + (u64)r * in + c, v);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = 0.0f;
        }
        const float f = 1.0f / QM_SCALE;
        uint4 o;
        if (bits == 8) {
            o.x = pack_f16x2(v[0] * f, v[1] * f);
            o.y = pack_f16x2(v[2] * f, v[3] * f);
            o.z = pack_f16x2(v[4] * f, v[5] * f);
            o.w = pack_f16x2(v[6] * f, v[7] * f);
        } else {
            o.x = pack_f16x2(v[0] * f, v[2] * f);
            o.y = pack_f16x2(v[4] * f, v[6] * f);
            o.z = pack_f16x2(v[1] * f, v[3] * f);
            o.w = pack_f16x2(v[5] * f, v[7] * f);
        }
        *(uint4*)(xh + (u64)r * in_pad + c) = o;
    }
}

// 8 bytes from global to shared memory, asynchronously (rows of the x tile are 8-byte
// aligned: QM_STRIDE keeps the fragment loads free of bank conflicts).
__device__ __forceinline__ void cp_async8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}

// Slab `sl` of the block's TR rows of rounded x into `dst` (one commit group).
template <int TR>
__device__ __forceinline__ void mmx_stage(u16* dst, const u16* __restrict__ xt, int in_pad,
                                          int sl) {
    const u16* src = xt + (u64)sl * QM_SLAB;
    for (int it = threadIdx.x; it < TR * (QM_SLAB / 4); it += QX_WARPS * 32) {
        int r = it / (QM_SLAB / 4), c = (it % (QM_SLAB / 4)) * 4;
        cp_async8(smem_u32(dst + r * QM_STRIDE + c), src + (u64)r * in_pad + c);
    }
    cp_async_commit();
}

// Waits for slab `sl`'s x in buffer `buf` after every warp is done with the other buffer,
// and starts the copy of slab `sl + 1` there (if the slice has it).
template <int TR>
__device__ __forceinline__ const u16* mmx_next_x(u16* xsh, const u16* __restrict__ xt,
                                                 int in_pad, int sl, int s1, int buf) {
    __syncthreads();
    if (sl + 1 < s1) {
        mmx_stage<TR>(xsh + (buf ^ 1) * TR * QM_STRIDE, xt, in_pad, sl + 1);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
    return xsh + buf * TR * QM_STRIDE;
}

// MT = 0: a tile of 8 rows of x, the weights' 16 rows of a warp as the mma's A operand and
// x's rows as its B (half the mma steps and x reads of a 16-row tile, for up to 8 rows).
template <typename S, int BITS, int MT, bool GLU>
__device__ void affine_mmx(const u16* __restrict__ xh, const u8* __restrict__ w,
                           const S* __restrict__ scales, const S* __restrict__ biases,
                           const float* __restrict__ bias, float* __restrict__ y,
                           float* __restrict__ part, int rows, int in, int out, int group) {
    const int TR = MT > 0 ? 16 * MT : 8;  // rows of the tile
    const int MA = MT > 0 ? MT : 1;
    extern __shared__ __align__(16) u16 xsh[];  // [2][TR][QM_STRIDE]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int o = blockIdx.x * (GLU ? QX_COLS / 2 : QX_COLS);
    int r0 = blockIdx.z * TR;
    u64 row_bytes = (u64)in * BITS / 8;
    int groups = in / group;
    int slabs = (in + QM_SLAB - 1) / QM_SLAB;
    int in_pad = slabs * QM_SLAB;
    int wrow[2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        int u = GLU ? o + 8 * warp + g : o + 16 * warp + 8 * nt + g;
        u = min(u, out - 1);
        wrow[nt] = GLU && nt == 1 ? out + u : u;
    }
    int per = (slabs + gridDim.y - 1) / gridDim.y;
    int s0 = blockIdx.y * per, s1 = min(slabs, s0 + per);
    float acc[MA][2][4];
#pragma unroll
    for (int mt = 0; mt < MA; mt++)
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][nt][i] = 0.0f;
    const u16* xt = xh + (u64)r0 * in_pad;
    pdl_launch();
    pdl_wait();
    if (s0 < s1) mmx_stage<TR>(xsh, xt, in_pad, s0);
    const int CHUNKS = QM_SLAB / (4 * (128 / BITS));
    for (int sl = s0; sl < s1; sl++) {
        // The slab's weights first: their loads fly while its x arrives.
        AffinePart<CHUNKS> a;
        affine_load<S, BITS, CHUNKS>(a, w, scales, biases, wrow, row_bytes, groups, in, group,
                                     sl * QM_SLAB, t);
        affine_mul<BITS, MT, CHUNKS>(a, mmx_next_x<TR>(xsh, xt, in_pad, sl, s1, (sl - s0) & 1),
                                     0, acc, g, t);
    }
    int cols = GLU ? 2 * out : out;
    if (MT == 0) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = r0 + 2 * t + (i & 1), nt = i >> 1;
            if (r >= rows) continue;
            if (GLU) {
                int u = o + 8 * warp + g;
                if (u >= out) continue;
                part[((u64)blockIdx.y * rows + r) * cols + nt * out + u] = acc[0][0][i];
            } else {
                int u = o + 16 * warp + 8 * nt + g;
                if (u >= out) continue;
                if (gridDim.y == 1)
                    y[(u64)r * out + u] = acc[0][0][i] + (bias ? bias[u] : 0.0f);
                else
                    part[((u64)blockIdx.y * rows + r) * cols + u] = acc[0][0][i];
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = r0 + 16 * mt + g + (i >= 2 ? 8 : 0);
            if (r >= rows) continue;
            int col = 2 * t + (i & 1);
            if (GLU) {
                int u = o + 8 * warp + col;
                if (u >= out) continue;
                float* pr = part + ((u64)blockIdx.y * rows + r) * cols;
                pr[u] = acc[mt][0][i];
                pr[out + u] = acc[mt][1][i];
            } else {
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    int u = o + 16 * warp + 8 * nt + col;
                    if (u >= out) continue;
                    if (gridDim.y == 1)
                        y[(u64)r * out + u] = acc[mt][nt][i] + (bias ? bias[u] : 0.0f);
                    else
                        part[((u64)blockIdx.y * rows + r) * cols + u] = acc[mt][nt][i];
                }
            }
        }
}

#define AFFINE_MMX(S, SN, BITS, MT)                                                            \
    extern "C" __global__ void __launch_bounds__(QX_WARPS * 32, QX_MIN_BLOCKS)                 \
        linear_mmx_q##BITS##_##SN##_m##MT(const u16* xh, const u8* w, const S* scales,          \
                                          const S* biases, const float* bias, float* y,         \
                                          float* part, int rows, int in, int out, int group) {  \
        affine_mmx<S, BITS, MT, false>(xh, w, scales, biases, bias, y, part, rows, in, out,    \
                                       group);                                                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(QX_WARPS * 32, QX_MIN_BLOCKS)                 \
        glu_mmx_q##BITS##_##SN##_m##MT(const u16* xh, const u8* w, const S* scales,             \
                                       const S* biases, float* y, float* part, int rows,        \
                                       int in, int width, int group) {                          \
        affine_mmx<S, BITS, MT, true>(xh, w, scales, biases, nullptr, y, part, rows, in, width, \
                                      group);                                                  \
    }
#define AFFINE_MMX_SIDES(BITS, MT)                                                             \
    AFFINE_MMX(Bf16, bf16, BITS, MT) AFFINE_MMX(F16, f16, BITS, MT) AFFINE_MMX(float, f32, BITS, MT)
// m0: tiles of 8 rows of x (the weights' rows are the mma's A, x's rows its B); m1, m2, m4:
// tiles of 16, 32 and 64 rows.
AFFINE_MMX_SIDES(8, 0)
AFFINE_MMX_SIDES(8, 1)
AFFINE_MMX_SIDES(8, 2)
AFFINE_MMX_SIDES(8, 4)
AFFINE_MMX_SIDES(4, 0)
AFFINE_MMX_SIDES(4, 1)
AFFINE_MMX_SIDES(4, 2)
AFFINE_MMX_SIDES(4, 4)

#define AFFINE_MMA(S, SN, BITS, MT)                                                            \
    extern "C" __global__ void __launch_bounds__(QM_WARPS * 32, QM_MIN_BLOCKS)                 \
        linear_mma_q##BITS##_##SN##_m##MT(const float* x, const u8* w, const S* scales,         \
                                          const S* biases, const float* bias, float* y,         \
                                          float* part, int rows, int in, int out, int group) {  \
        affine_mma<S, BITS, MT, false>(x, w, scales, biases, bias, y, part, rows, in, out,     \
                                       group);                                                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(QM_WARPS * 32, QM_MIN_BLOCKS)                 \
        glu_mma_q##BITS##_##SN##_m##MT(const float* x, const u8* w, const S* scales,            \
                                       const S* biases, float* y, float* part, int rows,        \
                                       int in, int width, int group) {                          \
        affine_mma<S, BITS, MT, true>(x, w, scales, biases, nullptr, y, part, rows, in, width, \
                                      group);                                                  \
    }
#define AFFINE_MMA_SIDES(BITS, MT)                                                             \
    AFFINE_MMA(Bf16, bf16, BITS, MT) AFFINE_MMA(F16, f16, BITS, MT) AFFINE_MMA(float, f32, BITS, MT)
AFFINE_MMA_SIDES(8, 1)
AFFINE_MMA_SIDES(8, 2)
AFFINE_MMA_SIDES(8, 4)
AFFINE_MMA_SIDES(4, 1)
AFFINE_MMA_SIDES(4, 2)
AFFINE_MMA_SIDES(4, 4)

// ---------------------------------------------------------------------------------------
// Affine products of a few rows on the int8 tensor cores (`affine_imma_*`)
//
// A batch of decoding streams multiplies each matrix by 3 to 64 rows: the weights' bytes
// are what the product waits for. (Opt-in: `WICK_CUDA_QUANT_IMMA_ROWS`.) `affine_imma_x` quantizes x once per product to int8 in
// blocks of 32 inputs (a scale and the block's exact sum each); then `mma.sync` m16n8k32
// multiplies the packed weights as they are (unsigned 4- or 8-bit codes, no dequantization)
// by those bytes, and each 32 inputs' integer sums become s·dx·Σq·qx + b·Σx — a group of 32
// or more inputs shares s and b, so a block of x never straddles two.
//
// A block of QI_WARPS warps makes 16 weight rows (GLU: 8 gate rows and their up rows) for
// 8·NT rows of x (blockIdx.y); its warps split the inputs, QI_STEPS blocks of 32 at a time
// with every load of those steps in flight before the first product, and add their sums
// up in shared memory at the end, so no partial sums leave the block.
//
// The order of a dot product's terms is free: lane (g = lane/4, t = lane%4) takes bytes
// 8t .. 8t + 7 of each of its two weight rows' 32 inputs (8 bits; 4 bits: bytes 4t .. 4t + 3,
// low nibbles then high) as the fragment's k-slots 4t .. 4t + 3 and 16 + 4t .. 19 + 4t, and
// x's bytes are stored in that order (4 bits: each 8 inputs as 0,2,4,6,1,3,5,7), so a lane's
// B fragment is one 8-byte load.

#define QI_WARPS 8
// Steps of 32 inputs whose loads a warp has in flight at once (fewer with more x rows,
// whose sums take the registers), and blocks an SM must fit (ptxas keeps the registers to
// 128 a thread).
#define QI_STEPS(NT) ((NT) == 1 ? 8 : (NT) <= 4 ? 4 : 2)
#define QI_MIN_BLOCKS 2

__device__ __forceinline__ void imma16832(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// x (rows × in, f32; in a multiple of 32) as `rows_pad` rows of int8 blocks of 32 (`xq`,
// rows × in bytes) and each block's (scale, exact sum) (`xs`, block-major: the rows of one
// block side by side); rows past `rows` are zeros.
extern "C" __global__ void affine_imma_x(const float* __restrict__ x, u8* __restrict__ xq,
                                         float2* __restrict__ xs, int rows, int in,
                                         int rows_pad, int bits) {
    pdl_begin();
    int blocks = in / 32;
    for (long long it = blockIdx.x * (long long)blockDim.x + threadIdx.x;
         it < (long long)rows_pad * blocks; it += (long long)gridDim.x * blockDim.x) {
        int r = (int)(it / blocks), b = (int)(it - (long long)r * blocks);
        float v[32];
        if (r < rows) {
#pragma unroll
            for (int q = 0; q < 4; q++) load8(x + (u64)r * in + 32 * b + 8 * q, v + 8 * q);
        } else {
#pragma unroll
            for (int e = 0; e < 32; e++) v[e] = 0.0f;
        }
        float amax = 0.0f, sum = 0.0f;
#pragma unroll
        for (int e = 0; e < 32; e++) {
            amax = fmaxf(amax, fabsf(v[e]));
            sum += v[e];
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int qi[32];
#pragma unroll
        for (int e = 0; e < 32; e++) qi[e] = __float2int_rn(v[e] * inv);
        u32 o[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int* q = qi + 8 * j;
            if (bits == 8) {
                o[2 * j] = pack_s8(q[0], q[1], q[2], q[3]);
                o[2 * j + 1] = pack_s8(q[4], q[5], q[6], q[7]);
            } else {
                o[2 * j] = pack_s8(q[0], q[2], q[4], q[6]);
                o[2 * j + 1] = pack_s8(q[1], q[3], q[5], q[7]);
            }
        }
        uint4* dst = (uint4*)(xq + (u64)r * in + 32 * b);
        dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
        dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
        xs[(u64)b * rows_pad + r] = make_float2(amax * (1.0f / 127.0f), sum);
    }
}

template <typename S, int BITS, int NT, bool GLU>
__device__ void affine_imma(const u8* __restrict__ xq, const float2* __restrict__ xs,
                            const u8* __restrict__ w, const S* __restrict__ scales,
                            const S* __restrict__ biases, const float* __restrict__ bias,
                            float* __restrict__ y, int rows, int in, int out, int group,
                            int act_kind) {
    const int SB = 32 * BITS / 8;  // a weight row's bytes per 32 inputs
    const int U = QI_STEPS(NT);
    __shared__ float red[QI_WARPS][16][8 * NT + 1];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int o = blockIdx.x * (GLU ? 8 : 16);
    int r0 = blockIdx.y * 8 * NT;
    // The lane's weight rows: A rows g and g + 8 (clamped: rows past the end are read,
    // never stored).
    int w0, w1;
    if (GLU) {
        w0 = min(o + g, out - 1);
        w1 = out + w0;
    } else {
        w0 = min(o + g, out - 1);
        w1 = min(o + 8 + g, out - 1);
    }
    u64 row_bytes = (u64)in * BITS / 8;
    int steps = in / 32, groups = in / group, per_group = group / 32;
    int rows_pad = gridDim.y * 8 * NT;
    const u8* wa = w + (u64)w0 * row_bytes + (BITS == 8 ? 8 : 4) * t;
    const u8* wb = w + (u64)w1 * row_bytes + (BITS == 8 ? 8 : 4) * t;
    const S* sa = scales + (u64)w0 * groups;
    const S* sb = scales + (u64)w1 * groups;
    const S* ba = biases + (u64)w0 * groups;
    const S* bb = biases + (u64)w1 * groups;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[nt][i] = 0.0f;
    pdl_launch();
    pdl_wait();
    for (int base = warp * U; base < steps; base += QI_WARPS * U) {
        // Every load of the steps first.
        u32 a[U][4];
        float sc[U][4];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int kk = min(base + u, steps - 1);
            if (BITS == 8) {
                uint2 p = *(const uint2*)(wa + (u64)kk * SB);
                uint2 q = *(const uint2*)(wb + (u64)kk * SB);
                a[u][0] = p.x;
                a[u][1] = q.x;
                a[u][2] = p.y;
                a[u][3] = q.y;
            } else {
                u32 p = *(const u32*)(wa + (u64)kk * SB);
                u32 q = *(const u32*)(wb + (u64)kk * SB);
                a[u][0] = p & 0x0f0f0f0fu;
                a[u][1] = q & 0x0f0f0f0fu;
                a[u][2] = (p >> 4) & 0x0f0f0f0fu;
                a[u][3] = (q >> 4) & 0x0f0f0f0fu;
            }
            int gi = kk / per_group;
            sc[u][0] = to_f32(sa[gi]);
            sc[u][1] = to_f32(ba[gi]);
            sc[u][2] = to_f32(sb[gi]);
            sc[u][3] = to_f32(bb[gi]);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int kk = base + u;
            if (kk >= steps) break;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                int xr = r0 + 8 * nt;
                uint2 bx = *(const uint2*)(xq + (u64)(xr + g) * in + 32 * kk + 8 * t);
                int c[4] = {0, 0, 0, 0};
                imma16832(c, a[u], bx.x, bx.y);
                // (scale, sum) of x rows 2t and 2t + 1 of the tile.
                float4 e = *(const float4*)(xs + (u64)kk * rows_pad + xr + 2 * t);
                acc[nt][0] = fmaf(sc[u][0] * e.x, (float)c[0], fmaf(sc[u][1], e.y, acc[nt][0]));
                acc[nt][1] = fmaf(sc[u][0] * e.z, (float)c[1], fmaf(sc[u][1], e.w, acc[nt][1]));
                acc[nt][2] = fmaf(sc[u][2] * e.x, (float)c[2], fmaf(sc[u][3], e.y, acc[nt][2]));
                acc[nt][3] = fmaf(sc[u][2] * e.z, (float)c[3], fmaf(sc[u][3], e.w, acc[nt][3]));
            }
        }
    }
    // acc[nt][i]: weight row g (+8 for i ≥ 2) of the tile, x row 8·nt + 2t + (i & 1).
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[warp][g + (i >= 2 ? 8 : 0)][8 * nt + 2 * t + (i & 1)] = acc[nt][i];
    __syncthreads();
    const int TW = GLU ? 8 : 16;
    for (int i = threadIdx.x; i < TW * 8 * NT; i += QI_WARPS * 32) {
        int j = i / (8 * NT), col = i - j * (8 * NT);
        int r = r0 + col, u = o + j;
        if (r >= rows || u >= out) continue;
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < QI_WARPS; k++) s += red[k][j][col];
        if (GLU) {
            float up = 0.0f;
#pragma unroll
            for (int k = 0; k < QI_WARPS; k++) up += red[k][j + 8][col];
            y[(u64)r * out + u] = act(s, act_kind) * up;
        } else {
            y[(u64)r * out + u] = s + (bias ? bias[u] : 0.0f);
        }
    }
}

#define AFFINE_IMMA(S, SN, BITS, NT)                                                           \
    extern "C" __global__ void __launch_bounds__(QI_WARPS * 32, QI_MIN_BLOCKS)                                \
        linear_imma_q##BITS##_##SN##_n##NT(const u8* xq, const float2* xs, const u8* w,         \
                                           const S* scales, const S* biases, const float* bias, \
                                           float* y, int rows, int in, int out, int group) {    \
        affine_imma<S, BITS, NT, false>(xq, xs, w, scales, biases, bias, y, rows, in, out,     \
                                        group, 0);                                             \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(QI_WARPS * 32, QI_MIN_BLOCKS)                                \
        glu_imma_q##BITS##_##SN##_n##NT(const u8* xq, const float2* xs, const u8* w,            \
                                        const S* scales, const S* biases, float* y, int rows,   \
                                        int in, int width, int group, int act_kind) {           \
        affine_imma<S, BITS, NT, true>(xq, xs, w, scales, biases, nullptr, y, rows, in, width, \
                                       group, act_kind);                                       \
    }
#define AFFINE_IMMA_SIDES(BITS, NT)                                                            \
    AFFINE_IMMA(Bf16, bf16, BITS, NT) AFFINE_IMMA(F16, f16, BITS, NT)                          \
    AFFINE_IMMA(float, f32, BITS, NT)
AFFINE_IMMA_SIDES(8, 1)
AFFINE_IMMA_SIDES(8, 2)
AFFINE_IMMA_SIDES(8, 4)
AFFINE_IMMA_SIDES(8, 8)
AFFINE_IMMA_SIDES(4, 1)
AFFINE_IMMA_SIDES(4, 2)
AFFINE_IMMA_SIDES(4, 4)
AFFINE_IMMA_SIDES(4, 8)
