// Qwen 3.5's gated DeltaNet on the GPU: the causal depthwise convolution with its state,
// the gated delta rule (token by token for decode steps and short rows, chunked for
// prompts), the gated RMS norm of its output, and the attention layers' sigmoid output gate.
//
// Compiled by NVRTC in one program after kernels.cu, whose helpers it uses (the integer
// typedefs, `warp_sum`, `block_sum`, `pdl_begin`). The host side is
// wick-engine/src/backend/cuda/deltanet.rs; the host reference the kernels follow is
// wick-engine/src/models/deltanet.rs.
//
// Layouts. The projections of a flattened batch of `n` rows: `mixed` `[n][cd]` with
// cd = 2·kh·kd + vh·vd (queries of the kh key heads, their keys, then the values of the vh
// value heads; value head h reads key head h / (vh / kh)), `z` `[n][vh·vd]`, `b` and `a`
// `[n][vh]`. A sequence's state in a layer: the convolution's last K − 1 inputs
// `[K−1][cd]` (oldest first) and the delta rule's `[vh][kd][vd]`, f32, as the host keeps
// them. Every step-varying value (state addresses, row ranges) comes in the uploaded
// `DeltaSeg`/`DeltaTile` arrays, so a decode step records the same launches every time.

#define DN_MAX_DIM 128              // largest key and value head size
#define DN_CONV_ROWS 64             // rows of one convolution tile (at least K − 1)
#define DN_CHUNK 64                 // tokens of one chunk of the chunked form
#define DN_REC_THREADS 512          // threads of a token-by-token block
#define DN_REC_GROUPS (DN_REC_THREADS / DN_MAX_DIM)
#define DN_REC_PER (DN_MAX_DIM / DN_REC_GROUPS)
#define DN_SLAB 16                  // key/value dimensions staged at a time (chunk prep)
#define DN_COLS 32                  // state columns of one chunk-state block

// One sequence's rows of the batch and its state in the layer.
struct DeltaSeg {
    u64 conv;    // float [K−1][cd]
    u64 ssm;     // float [vh][kd][vd]
    int row0;    // first row in the batch
    int rows;
    int chunk0;  // its first chunk tile (chunked form)
    int chunks;
};

// Consecutive rows of one segment: a convolution tile, or a chunk of the chunked form.
struct DeltaTile {
    int seg;
    int row0;
    int rows;
    int pad;
};

__device__ __forceinline__ float dn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// torch's softplus (linear above 20).
__device__ __forceinline__ float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float dn_silu(float x) { return x / (1.0f + expf(-x)); }

// SiLU of the causal depthwise convolution of `x` `[n][cd]` into `out`, continuing each
// segment's state (`w` `[cd][K]`: tap j multiplies the input K − 1 − j rows back). Grid:
// (tiles, channel blocks of 256). Only a segment's first tile reads its state (later
// tiles start at least K − 1 rows in), so the thread of that tile and channel writes the
// new state, after its reads: the last K − 1 inputs of state ++ rows.
extern "C" __global__ void delta_conv(const float* __restrict__ x, float* __restrict__ out,
                                      const float* __restrict__ w,
                                      const DeltaSeg* __restrict__ segs,
                                      const DeltaTile* __restrict__ tiles, int cd, int K) {
    pdl_begin();
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    const DeltaTile t = tiles[blockIdx.x];
    const DeltaSeg s = segs[t.seg];
    float* st = (float*)s.conv;
    const int hist = K - 1;
    const float* wc = w + (long long)c * K;
    const int first = t.row0 - s.row0;
    for (int r = 0; r < t.rows; r++) {
        const int i = first + r;
        float acc = 0.0f;
        for (int j = 0; j < K; j++) {
            const int e = i + j;  // index into state ++ rows
            const float v = e < hist ? st[(long long)e * cd + c]
                                     : x[(long long)(s.row0 + e - hist) * cd + c];
            acc = fmaf(wc[j], v, acc);
        }
        out[(long long)(s.row0 + i) * cd + c] = dn_silu(acc);
    }
    if (first == 0) {
        // Entry m takes index rows + m of state ++ rows; reading index rows + m ≥ m after
        // writing the entries before m never reads a written one.
        for (int m = 0; m < hist; m++) {
            const int e = s.rows + m;
            st[(long long)m * cd + c] = e < hist ? st[(long long)e * cd + c]
                                                 : x[(long long)(s.row0 + e - hist) * cd + c];
        }
    }
}

// The delta rule token by token, then the gated RMS norm, for the segments `list` names:
// one block per (segment, value head), the head's state in registers. Thread t keeps
// column j = t % 128 of rows i ≡ t / 128 (mod 4) of the `[kd][vd]` state, so the state's
// reads and writes are coalesced and each token costs two reductions over the four row
// groups. Per token: q and k normalized (q also scaled by kd^-½), the state decayed by
// exp(g), d = β (v − Sᵀk), S += k ⊗ d, o = Sᵀq, out = silu(z) · w · o / rms(o).
extern "C" __global__ void __launch_bounds__(DN_REC_THREADS)
    delta_recurrent(const float* __restrict__ mixed, const float* __restrict__ z,
                    const float* __restrict__ bb, const float* __restrict__ aa,
                    float* __restrict__ out, const DeltaSeg* __restrict__ segs,
                    const int* __restrict__ list, const float* __restrict__ neg_a,
                    const float* __restrict__ dt_bias, const float* __restrict__ norm_w, int kh,
                    int vh, int kd, int vd, float scale, float eps) {
    __shared__ float qs[DN_MAX_DIM], ks[DN_MAX_DIM];
    __shared__ float red[DN_REC_GROUPS][DN_MAX_DIM];
    pdl_begin();
    const DeltaSeg s = segs[list[blockIdx.x]];
    const int h = blockIdx.y, hk = h / (vh / kh);
    const int tid = threadIdx.x, j = tid % DN_MAX_DIM, grp = tid / DN_MAX_DIM;
    const long long cd = 2LL * kh * kd + (long long)vh * vd, vt = (long long)vh * vd;
    float* S = (float*)s.ssm + (long long)h * kd * vd;
    float st[DN_REC_PER];
#pragma unroll
    for (int m = 0; m < DN_REC_PER; m++) {
        const int i = grp + DN_REC_GROUPS * m;
        st[m] = (i < kd && j < vd) ? S[(long long)i * vd + j] : 0.0f;
    }
    const float na = neg_a[h], dtb = dt_bias[h], wj = j < vd ? norm_w[j] : 0.0f;
    for (int r = 0; r < s.rows; r++) {
        const long long row = s.row0 + r;
        const float* xr = mixed + row * cd;
        float qv = 0.0f, kv = 0.0f;
        if (tid < kd) {
            qv = xr[(long long)hk * kd + tid];
            kv = xr[(long long)(kh + hk) * kd + tid];
        }
        // Barriers inside: every read of qs, ks and red of the previous token is done.
        const float sq = block_sum(qv * qv);
        const float sk = block_sum(kv * kv);
        if (tid < kd) {
            qs[tid] = qv * (1.0f / sqrtf(sq + 1e-6f)) * scale;
            ks[tid] = kv * (1.0f / sqrtf(sk + 1e-6f));
        }
        const float beta = dn_sigmoid(bb[row * vh + h]);
        const float decay = expf(na * dn_softplus(aa[row * vh + h] + dtb));
        const float vj = j < vd ? xr[2LL * kh * kd + (long long)h * vd + j] : 0.0f;
        __syncthreads();
        float part = 0.0f;
#pragma unroll
        for (int m = 0; m < DN_REC_PER; m++) {
            const int i = grp + DN_REC_GROUPS * m;
            if (i < kd) {
                st[m] *= decay;
                part = fmaf(st[m], ks[i], part);
            }
        }
        red[grp][j] = part;
        __syncthreads();
        float kvj = 0.0f;
#pragma unroll
        for (int g = 0; g < DN_REC_GROUPS; g++) kvj += red[g][j];
        const float d = (vj - kvj) * beta;
        __syncthreads();
        float po = 0.0f;
#pragma unroll
        for (int m = 0; m < DN_REC_PER; m++) {
            const int i = grp + DN_REC_GROUPS * m;
            if (i < kd) {
                st[m] = fmaf(ks[i], d, st[m]);
                po = fmaf(st[m], qs[i], po);
            }
        }
        red[grp][j] = po;
        __syncthreads();
        float o = 0.0f;
#pragma unroll
        for (int g = 0; g < DN_REC_GROUPS; g++) o += red[g][j];
        const bool mine = grp == 0 && j < vd;
        const float ss = block_sum(mine ? o * o : 0.0f);
        if (mine) {
            const float inv = 1.0f / sqrtf(ss / (float)vd + eps);
            const long long at = row * vt + (long long)h * vd + j;
            out[at] = dn_silu(z[at]) * (wj * (o * inv));
        }
    }
#pragma unroll
    for (int m = 0; m < DN_REC_PER; m++) {
        const int i = grp + DN_REC_GROUPS * m;
        if (i < kd && j < vd) S[(long long)i * vd + j] = st[m];
    }
}

// Chunked form, step 1, per (chunk tile, key head): q and k of each row normalized in
// place (q scaled by kd^-½), and each value head's log decay g and write strength β.
extern "C" __global__ void delta_prep(float* __restrict__ mixed, const float* __restrict__ bb,
                                      const float* __restrict__ aa, float* __restrict__ g_out,
                                      float* __restrict__ beta_out,
                                      const DeltaTile* __restrict__ tiles,
                                      const float* __restrict__ neg_a,
                                      const float* __restrict__ dt_bias, int kh, int vh, int kd,
                                      int vd, float scale) {
    pdl_begin();
    const DeltaTile t = tiles[blockIdx.x];
    const int hk = blockIdx.y, per = vh / kh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const long long cd = 2LL * kh * kd + (long long)vh * vd;
    for (int r = warp; r < t.rows; r += warps) {
        const long long row = t.row0 + r;
        float* q = mixed + row * cd + (long long)hk * kd;
        float* k = q + (long long)kh * kd;
        float sq = 0.0f, sk = 0.0f;
        for (int i = lane; i < kd; i += 32) {
            sq = fmaf(q[i], q[i], sq);
            sk = fmaf(k[i], k[i], sk);
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        const float iq = 1.0f / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
        for (int i = lane; i < kd; i += 32) {
            q[i] = q[i] * iq * scale;
            k[i] = k[i] * ik;
        }
        for (int v = lane; v < per; v += 32) {
            const int h = hk * per + v;
            g_out[row * vh + h] = neg_a[h] * dn_softplus(aa[row * vh + h] + dt_bias[h]);
            beta_out[row * vh + h] = dn_sigmoid(bb[row * vh + h]);
        }
    }
}

// Chunked form, step 2, per (chunk tile, value head): what does not depend on the state.
// With G the cumulative log decay inside the chunk (`gc`, kept for step 3):
// A = strict_lower(β_i k_i·k_j e^(G_i − G_j)), T = (I + A)⁻¹ (forward substitution),
// W = T (β K e^G) and U = T (β V) (`[n][vh][kd]`, `[n][vh][vd]`), and the chunk's
// P = lower(q_i·k_j e^(G_i − G_j)) (`[tile][vh][64][64]`). 256 threads; thread
// (ty, tx) = (t / 16, t % 16) makes the 64×64 products' entries (ty + 16a, tx + 16b).
extern "C" __global__ void __launch_bounds__(256)
    delta_chunk_prep(const float* __restrict__ mixed, const float* __restrict__ g,
                     const float* __restrict__ beta, float* __restrict__ gc,
                     float* __restrict__ W, float* __restrict__ U, float* __restrict__ P,
                     const DeltaTile* __restrict__ tiles, int kh, int vh, int kd, int vd) {
    __shared__ float A[DN_CHUNK][DN_CHUNK + 1];
    __shared__ float T[DN_CHUNK][DN_CHUNK + 1];
    __shared__ float X[DN_CHUNK][DN_SLAB + 1];
    __shared__ float Y[DN_CHUNK][DN_SLAB + 1];
    __shared__ float G[DN_CHUNK], B[DN_CHUNK], E[DN_CHUNK];
    pdl_begin();
    const DeltaTile t = tiles[blockIdx.x];
    const int h = blockIdx.y, hk = h / (vh / kh), L = t.rows;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const long long cd = 2LL * kh * kd + (long long)vh * vd;
    const long long qo = (long long)hk * kd, ko = (long long)(kh + hk) * kd;
    const long long vo = 2LL * kh * kd + (long long)h * vd;
    if (tid < 32) {
        // Inclusive prefix sum of g over the chunk, a warp at a time.
        float carry = 0.0f;
        for (int base = 0; base < L; base += 32) {
            const int i = base + tid;
            float v = i < L ? g[(long long)(t.row0 + i) * vh + h] : 0.0f;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float u = __shfl_up_sync(0xffffffffu, v, o);
                if (tid >= o) v += u;
            }
            v += carry;
            if (i < L) {
                G[i] = v;
                gc[(long long)(t.row0 + i) * vh + h] = v;
            }
            carry = __shfl_sync(0xffffffffu, v, 31);
        }
    }
    if (tid < L) B[tid] = beta[(long long)(t.row0 + tid) * vh + h];
    __syncthreads();
    if (tid < L) E[tid] = B[tid] * expf(G[tid]);

    // K Kᵀ and Q Kᵀ over slabs of DN_SLAB key dimensions.
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) kk[a][b] = qk[a][b] = 0.0f;
    for (int c0 = 0; c0 < kd; c0 += DN_SLAB) {
        for (int e = tid; e < DN_CHUNK * DN_SLAB; e += 256) {
            const int r = e / DN_SLAB, c = e % DN_SLAB;
            const bool ok = r < L && c0 + c < kd;
            const float* xr = mixed + (long long)(t.row0 + r) * cd;
            X[r][c] = ok ? xr[ko + c0 + c] : 0.0f;
            Y[r][c] = ok ? xr[qo + c0 + c] : 0.0f;
        }
        __syncthreads();
#pragma unroll 4
        for (int c = 0; c < DN_SLAB; c++) {
            float ka[4], qa[4], kb[4];
#pragma unroll
            for (int a = 0; a < 4; a++) {
                ka[a] = X[ty + 16 * a][c];
                qa[a] = Y[ty + 16 * a][c];
                kb[a] = X[tx + 16 * a][c];
            }
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    kk[a][b] = fmaf(ka[a], kb[b], kk[a][b]);
                    qk[a][b] = fmaf(qa[a], kb[b], qk[a][b]);
                }
        }
        __syncthreads();
    }
    float* Pt = P + ((long long)blockIdx.x * vh + h) * DN_CHUNK * DN_CHUNK;
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const int i = ty + 16 * a, j = tx + 16 * b;
            const bool lower = j <= i && i < L;
            const float decay = lower ? expf(G[i] - G[j]) : 0.0f;
            A[i][j] = (lower && j < i) ? B[i] * kk[a][b] * decay : 0.0f;
            T[i][j] = i == j ? 1.0f : 0.0f;
            Pt[i * DN_CHUNK + j] = lower ? qk[a][b] * decay : 0.0f;
        }
    __syncthreads();
    // T = (I + A)⁻¹: row i from the rows before it, T[i][c] = −A[i][c] − Σ_{c<j<i} A[i][j] T[j][c].
    for (int i = 1; i < L; i++) {
        if (tid < i) {
            float sum = A[i][tid];
            for (int j = tid + 1; j < i; j++) sum = fmaf(A[i][j], T[j][tid], sum);
            T[i][tid] = -sum;
        }
        __syncthreads();
    }
    // W = T (β K e^G) and U = T (β V), DN_SLAB output columns at a time.
    for (int pass = 0; pass < 2; pass++) {
        const int width = pass == 0 ? kd : vd;
        float* dst = pass == 0 ? W : U;
        for (int c0 = 0; c0 < width; c0 += DN_SLAB) {
            for (int e = tid; e < DN_CHUNK * DN_SLAB; e += 256) {
                const int r = e / DN_SLAB, c = e % DN_SLAB;
                const bool ok = r < L && c0 + c < width;
                const float* xr = mixed + (long long)(t.row0 + r) * cd;
                X[r][c] = ok ? (pass == 0 ? xr[ko + c0 + c] * E[r] : xr[vo + c0 + c] * B[r])
                             : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int a = 0; a < 4; a++) {
                const int i = ty + 16 * a;
                if (i < L && c0 + tx < width) {
                    float acc = 0.0f;
                    for (int s2 = 0; s2 <= i; s2++) acc = fmaf(T[i][s2], X[s2][tx], acc);
                    dst[((long long)(t.row0 + i) * vh + h) * width + c0 + tx] = acc;
                }
            }
            __syncthreads();
        }
    }
}

// Chunked form, step 3, per (segment, value head, DN_COLS state columns), the segment's
// chunks in order: with S the state before the chunk (columns of the state are
// independent, so blocks of columns need no exchange), V' = U − W S,
// o_i = e^(G_i) (S q_i) + Σ_{j≤i} P_ij V'_j (raw, into `o`), and
// S ← e^(G_L) S + Σ_i (k_i e^(G_L − G_i)) ⊗ V'_i. 256 threads: lane = column, warp w takes
// rows w, w + 8, … of the chunk and of the state.
extern "C" __global__ void __launch_bounds__(256)
    delta_chunk_state(const float* __restrict__ mixed, const float* __restrict__ gc,
                      const float* __restrict__ W, const float* __restrict__ U,
                      const float* __restrict__ P, float* __restrict__ o_out,
                      const DeltaSeg* __restrict__ segs, const int* __restrict__ list,
                      const DeltaTile* __restrict__ tiles, int kh, int vh, int kd, int vd) {
    __shared__ float S[DN_MAX_DIM][DN_COLS + 1];
    __shared__ float Vn[DN_CHUNK][DN_COLS + 1];
    __shared__ float Gs[DN_CHUNK], Ed[DN_CHUNK];
    pdl_begin();
    const DeltaSeg s = segs[list[blockIdx.x]];
    const int h = blockIdx.y, hk = h / (vh / kh);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.z * DN_COLS + lane;
    const bool col = j < vd;
    const long long cd = 2LL * kh * kd + (long long)vh * vd;
    const long long qo = (long long)hk * kd, ko = (long long)(kh + hk) * kd;
    float* Sg = (float*)s.ssm + (long long)h * kd * vd;
    for (int i = warp; i < kd; i += 8) S[i][lane] = col ? Sg[(long long)i * vd + j] : 0.0f;
    for (int ci = 0; ci < s.chunks; ci++) {
        const int tile = s.chunk0 + ci;
        const DeltaTile t = tiles[tile];
        const int L = t.rows;
        if (threadIdx.x < L) Gs[threadIdx.x] = gc[(long long)(t.row0 + threadIdx.x) * vh + h];
        __syncthreads();
        if (threadIdx.x < L) Ed[threadIdx.x] = expf(Gs[L - 1] - Gs[threadIdx.x]);
        float vacc[8], oacc[8];
#pragma unroll
        for (int m = 0; m < 8; m++) vacc[m] = oacc[m] = 0.0f;
        for (int i = 0; i < kd; i++) {
            const float sv = S[i][lane];
#pragma unroll
            for (int m = 0; m < 8; m++) {
                const int r = warp + 8 * m;
                if (r < L) {
                    const long long row = t.row0 + r;
                    vacc[m] = fmaf(W[(row * vh + h) * kd + i], sv, vacc[m]);
                    oacc[m] = fmaf(mixed[row * cd + qo + i], sv, oacc[m]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < 8; m++) {
            const int r = warp + 8 * m;
            if (r < L) {
                const long long row = t.row0 + r;
                const float u = col ? U[(row * vh + h) * vd + j] : 0.0f;
                Vn[r][lane] = u - vacc[m];
            }
        }
        __syncthreads();
        const float* Pt = P + ((long long)tile * vh + h) * DN_CHUNK * DN_CHUNK;
#pragma unroll
        for (int m = 0; m < 8; m++) {
            const int r = warp + 8 * m;
            if (r < L) {
                float o = expf(Gs[r]) * oacc[m];
                for (int s2 = 0; s2 <= r; s2++) o = fmaf(Pt[r * DN_CHUNK + s2], Vn[s2][lane], o);
                if (col) o_out[((long long)(t.row0 + r) * vh + h) * vd + j] = o;
            }
        }
        // Every read of S above came before the barrier; each thread now updates its rows.
        const float dl = expf(Gs[L - 1]);
        for (int i = warp; i < kd; i += 8) {
            float acc = S[i][lane] * dl;
            for (int r = 0; r < L; r++)
                acc = fmaf(mixed[(long long)(t.row0 + r) * cd + ko + i] * Ed[r], Vn[r][lane], acc);
            S[i][lane] = acc;
        }
        __syncthreads();
    }
    if (col)
        for (int i = warp; i < kd; i += 8) Sg[(long long)i * vd + j] = S[i][lane];
}

// Chunked form, step 4, per (chunk tile, value head): out = silu(z) · w · o / rms(o), a
// warp per row.
extern "C" __global__ void delta_gated_norm(const float* __restrict__ o,
                                            const float* __restrict__ z,
                                            const float* __restrict__ norm_w,
                                            float* __restrict__ out,
                                            const DeltaTile* __restrict__ tiles, int vh, int vd,
                                            float eps) {
    pdl_begin();
    const DeltaTile t = tiles[blockIdx.x];
    const int h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const long long vt = (long long)vh * vd;
    for (int r = warp; r < t.rows; r += warps) {
        const long long base = (long long)(t.row0 + r) * vt + (long long)h * vd;
        float ss = 0.0f;
        for (int i = lane; i < vd; i += 32) ss = fmaf(o[base + i], o[base + i], ss);
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)vd + eps);
        for (int i = lane; i < vd; i += 32)
            out[base + i] = dn_silu(z[base + i]) * (norm_w[i] * (o[base + i] * inv));
    }
}

// out = x · sigmoid(g) (an attention layer's output gate).
extern "C" __global__ void sigmoid_gate(const float* x, const float* g, float* out,
                                        long long n) {
    pdl_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = x[i] / (1.0f + expf(-g[i]));
}
