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

// ---------------------------------------------------------------------------------------
// Chunked form, step 3 on the tensor cores (`delta_chunk_state_tc`; `delta_chunk_state`
// above is the same arithmetic on the CUDA cores, kept for comparison:
// `WICK_CUDA_DELTA_MMA=0`).
//
// A block takes one (segment, value head, DN_TC_COLS state columns), so a single prompt of
// the 4B shape (32 value heads of 128 columns) runs 256 blocks. Per chunk its four warps
// make, with `mma.sync` m16n8k8 (tf32 inputs, f32 sums):
//   A. V' = U − W S and Q S, warp w rows 16w … 16w + 15 of the chunk (K = key dims);
//   B. o = e^G ⊙ (Q S) + P V' for those rows (K = the chunk's rows up to the warp's last);
//   C. S ← e^(G_L) S + (K ⊙ e^(G_L − G))ᵀ V', warp w state rows 32w … 32w + 31.
// The state stays f32 in the registers of C's accumulators (a copy in shared memory is the
// B operand of A). Each operand is carried as a tf32 pair hi + lo (lo = tf32(x − hi)) and a
// product as hi·hi + hi·lo + lo·hi, which leaves an error of about 2⁻²¹ of each product
// (tf32 alone: 2⁻¹¹), so the result matches the CUDA-core form to f32 rounding.
//
// Fragments of m16n8k8 tf32, g = lane / 4, q = lane % 4: A (16 × 8) a0 (g, q), a1 (g + 8, q),
// a2 (g, q + 4), a3 (g + 8, q + 4); B (8 × 8) b0 (q, g), b1 (q + 4, g); C (16 × 8)
// c0 (g, 2q), c1 (g, 2q + 1), c2 (g + 8, 2q), c3 (g + 8, 2q + 1).
#define DN_TC_COLS 16                   // state columns of one block
#define DN_TC_THREADS 128               // four warps: 4 × 16 chunk rows, 4 × 32 state rows
#define DN_TC_STRIDE (DN_TC_COLS + 8)   // shared row stride: B reads fall in distinct banks
static_assert(DN_TC_THREADS / 32 * 16 == DN_CHUNK, "a warp takes 16 rows of a chunk");
static_assert(DN_TC_THREADS / 32 * 32 == DN_MAX_DIM, "a warp takes 32 rows of the state");
static_assert(DN_TC_COLS == 16, "a warp's tiles are two 8-column fragments wide");

// x as hi + lo, both tf32 (round to nearest).
__device__ __forceinline__ void dn_split(float x, u32& hi, u32& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
    const float rest = x - __uint_as_float(hi);
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(rest));
}

// An A fragment (16 × 8) or B fragment (8 × 8) as tf32 pairs.
struct DnA {
    u32 hi[4], lo[4];
};
struct DnB {
    u32 hi[2], lo[2];
};

__device__ __forceinline__ DnA dn_a(float a0, float a1, float a2, float a3) {
    DnA f;
    dn_split(a0, f.hi[0], f.lo[0]);
    dn_split(a1, f.hi[1], f.lo[1]);
    dn_split(a2, f.hi[2], f.lo[2]);
    dn_split(a3, f.hi[3], f.lo[3]);
    return f;
}

__device__ __forceinline__ DnB dn_b(float b0, float b1) {
    DnB f;
    dn_split(b0, f.hi[0], f.lo[0]);
    dn_split(b1, f.hi[1], f.lo[1]);
    return f;
}

__device__ __forceinline__ void dn_mma_tf32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// d += a·b in split precision (the small cross products first).
__device__ __forceinline__ void dn_mma(float (&d)[4], const DnA& a, const DnB& b) {
    dn_mma_tf32(d, a.lo, b.hi);
    dn_mma_tf32(d, a.hi, b.lo);
    dn_mma_tf32(d, a.hi, b.hi);
}

extern "C" __global__ void __launch_bounds__(DN_TC_THREADS)
    delta_chunk_state_tc(const float* __restrict__ mixed, const float* __restrict__ gc,
                         const float* __restrict__ W, const float* __restrict__ U,
                         const float* __restrict__ P, float* __restrict__ o_out,
                         const DeltaSeg* __restrict__ segs, const int* __restrict__ list,
                         const DeltaTile* __restrict__ tiles, int kh, int vh, int kd, int vd) {
    __shared__ float S[DN_MAX_DIM][DN_TC_STRIDE];  // the state's columns (B of step A)
    __shared__ float Vn[DN_CHUNK][DN_TC_STRIDE];   // V' (B of steps B and C)
    // e^G and e^(G_L − G) of the chunk, two buffers: a chunk writes one while the warps
    // still finishing the chunk before read the other.
    __shared__ float Eg[2][DN_CHUNK], Ed[2][DN_CHUNK];
    pdl_begin();
    const DeltaSeg s = segs[list[blockIdx.x]];
    const int h = blockIdx.y, hk = h / (vh / kh);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int c0 = blockIdx.z * DN_TC_COLS;
    const long long cd = 2LL * kh * kd + (long long)vh * vd;
    const long long qo = (long long)hk * kd, ko = (long long)(kh + hk) * kd;
    float* Sg = (float*)s.ssm + (long long)h * kd * vd;

    // The warp's state rows in C layout: sr[m][n] is the 16 × 8 tile of rows
    // 32·warp + 16m …, columns c0 + 8n …; rows past kd and columns past vd stay 0.
    float sr[2][2][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = 32 * warp + 16 * m + g + 8 * (e >> 1);
                const int c = 8 * n + 2 * q + (e & 1);
                const bool ok = i < kd && c0 + c < vd;
                sr[m][n][e] = ok ? Sg[(long long)i * vd + c0 + c] : 0.0f;
                S[i][c] = sr[m][n][e];
            }

    for (int ci = 0; ci < s.chunks; ci++) {
        const int tile = s.chunk0 + ci, buf = ci & 1;
        const DeltaTile t = tiles[tile];
        const int L = t.rows;
        if (threadIdx.x < DN_CHUNK) {
            const int r = threadIdx.x;
            const float gl = gc[(long long)(t.row0 + L - 1) * vh + h];
            const float gr = r < L ? gc[(long long)(t.row0 + r) * vh + h] : 0.0f;
            Eg[buf][r] = r < L ? expf(gr) : 0.0f;
            Ed[buf][r] = r < L ? expf(gl - gr) : 0.0f;
        }
        // S (written at the end of the chunk before) and this chunk's Eg, Ed are complete;
        // every warp is done with the chunk before's Vn.
        __syncthreads();

        // A. The warp's rows r0 = 16·warp + g and r1 = r0 + 8 of the chunk.
        const int r0 = 16 * warp + g, r1 = r0 + 8;
        const bool ok0 = r0 < L, ok1 = r1 < L;
        const long long row0 = t.row0 + r0, row1 = t.row0 + r1;
        const float* w0 = W + (row0 * vh + h) * kd;
        const float* w1 = W + (row1 * vh + h) * kd;
        const float* q0 = mixed + row0 * cd + qo;
        const float* q1 = mixed + row1 * cd + qo;
        float av[2][4], aq[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) av[n][e] = aq[n][e] = 0.0f;
#pragma unroll 4
        for (int k0 = 0; k0 < kd; k0 += 8) {
            const int ka = k0 + q, kb = ka + 4;
            const bool ia = ka < kd, ib = kb < kd;
            const DnA wa = dn_a(ok0 && ia ? w0[ka] : 0.0f, ok1 && ia ? w1[ka] : 0.0f,
                                ok0 && ib ? w0[kb] : 0.0f, ok1 && ib ? w1[kb] : 0.0f);
            const DnA qa = dn_a(ok0 && ia ? q0[ka] : 0.0f, ok1 && ia ? q1[ka] : 0.0f,
                                ok0 && ib ? q0[kb] : 0.0f, ok1 && ib ? q1[kb] : 0.0f);
#pragma unroll
            for (int n = 0; n < 2; n++) {
                // Rows of S past kd are zeros (ka, kb < 128 = DN_MAX_DIM).
                const DnB sb = dn_b(S[ka][8 * n + g], S[kb][8 * n + g]);
                dn_mma(av[n], wa, sb);
                dn_mma(aq[n], qa, sb);
            }
        }
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e < 2 ? r0 : r1, c = 8 * n + 2 * q + (e & 1);
                const bool ok = r < L && c0 + c < vd;
                const float u =
                    ok ? U[(((long long)t.row0 + r) * vh + h) * vd + c0 + c] : 0.0f;
                Vn[r][c] = ok ? u - av[n][e] : 0.0f;
            }
        // Vn is complete, and every warp's reads of S for this chunk are done.
        __syncthreads();

        // B. o of the warp's rows: P is lower triangular (zeros past the diagonal and in
        // rows past L), so keys past the warp's last row add nothing.
        const float* Pt = P + ((long long)tile * vh + h) * DN_CHUNK * DN_CHUNK;
        float ao[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) ao[n][e] = Eg[buf][e < 2 ? r0 : r1] * aq[n][e];
        for (int k0 = 0; k0 < 16 * (warp + 1); k0 += 8) {
            const int ka = k0 + q, kb = ka + 4;
            const DnA pa = dn_a(Pt[r0 * DN_CHUNK + ka], Pt[r1 * DN_CHUNK + ka],
                                Pt[r0 * DN_CHUNK + kb], Pt[r1 * DN_CHUNK + kb]);
#pragma unroll
            for (int n = 0; n < 2; n++)
                dn_mma(ao[n], pa, dn_b(Vn[ka][8 * n + g], Vn[kb][8 * n + g]));
        }
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e < 2 ? r0 : r1, c = c0 + 8 * n + 2 * q + (e & 1);
                if (r < L && c < vd) o_out[(((long long)t.row0 + r) * vh + h) * vd + c] = ao[n][e];
            }

        // C. The warp's state rows; rows of the chunk past L have Vn = 0 and Ed = 0.
        const float dl = Eg[buf][L - 1];
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) sr[m][n][e] *= dl;
        for (int k0 = 0; k0 < L; k0 += 8) {
            const int ra = k0 + q, rb = ra + 4;
            const bool oka = ra < L, okb = rb < L;
            const float ea = Ed[buf][ra], eb = Ed[buf][rb];
            const float* ka_row = mixed + ((long long)t.row0 + ra) * cd + ko;
            const float* kb_row = mixed + ((long long)t.row0 + rb) * cd + ko;
            DnB vb[2];
#pragma unroll
            for (int n = 0; n < 2; n++) vb[n] = dn_b(Vn[ra][8 * n + g], Vn[rb][8 * n + g]);
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const int i0 = 32 * warp + 16 * m + g, i1 = i0 + 8;
                const DnA ka = dn_a(oka && i0 < kd ? ka_row[i0] * ea : 0.0f,
                                    oka && i1 < kd ? ka_row[i1] * ea : 0.0f,
                                    okb && i0 < kd ? kb_row[i0] * eb : 0.0f,
                                    okb && i1 < kd ? kb_row[i1] * eb : 0.0f);
#pragma unroll
                for (int n = 0; n < 2; n++) dn_mma(sr[m][n], ka, vb[n]);
            }
        }
        // Every warp passed the barrier after step A, so none reads S any more this chunk.
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    S[32 * warp + 16 * m + g + 8 * (e >> 1)][8 * n + 2 * q + (e & 1)] =
                        sr[m][n][e];
    }
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = 32 * warp + 16 * m + g + 8 * (e >> 1);
                const int c = c0 + 8 * n + 2 * q + (e & 1);
                if (i < kd && c < vd) Sg[(long long)i * vd + c] = sr[m][n][e];
            }
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
