#!/usr/bin/env python3
"""Emulates the int8 tensor-core affine product of crates/wick-cuda/src/kernels.cu
(`affine_imma_x`, then `linear_imma_*` / `glu_imma_*`) lane by lane, with the fragment
layouts PTX documents for mma.m16n8k32 (u8 × s8), so that its indexing (the lanes' bytes,
the 4-bit nibble order, the block-major x scales, the GLU rows) can be checked without a
GPU. For 4- and 8-bit weights, groups of 32 to 128, plain and GLU, one and two n-tiles:

- against the product the kernel means to compute (x as its int8 blocks give it back,
  the bias term with the blocks' exact sums): must agree to f32 rounding;
- against the f32 product of the dequantized weights: prints the error int8 x adds.

    python3 scripts/gpu/imma_emulate.py      # numpy only; about 20 s
"""
import numpy as np
rng = np.random.default_rng(1)

def quantize_affine(w, bits, group):
    out, inn = w.shape
    g = w.reshape(out, inn // group, group)
    lo, hi = g.min(-1), g.max(-1)
    levels = (1 << bits) - 1
    s = np.where(hi > lo, (hi - lo) / levels, 1.0).astype(np.float32)
    b = lo.astype(np.float32)
    q = np.clip(np.rint((g - b[..., None]) / s[..., None]), 0, levels).astype(np.uint8).reshape(out, inn)
    deq = (q.reshape(out, inn // group, group) * s[..., None] + b[..., None]).reshape(out, inn)
    if bits == 8:
        packed = q.copy()
    else:
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # value 2j low nibble, 2j+1 high
    return packed, s, b, deq

def imma_x(x, rows_pad, bits):
    rows, inn = x.shape
    blocks = inn // 32
    xq = np.zeros((rows_pad, inn), np.int8)
    xs = np.zeros((blocks, rows_pad, 2), np.float32)  # block-major
    for r in range(rows_pad):
        for bk in range(blocks):
            v = x[r, 32*bk:32*bk+32] if r < rows else np.zeros(32, np.float32)
            amax = np.abs(v).max()
            inv = 127.0 / amax if amax > 0 else 0.0
            qi = np.rint(v * inv).astype(np.int32)
            if bits == 8:
                order = list(range(32))
            else:
                order = []
                for j in range(4):
                    order += [8*j+0, 8*j+2, 8*j+4, 8*j+6, 8*j+1, 8*j+3, 8*j+5, 8*j+7]
            xq[r, 32*bk:32*bk+32] = qi[order]
            xs[bk, r] = (amax / 127.0, v.sum())
    return xq, xs

def bytes_of(u32s):
    return np.frombuffer(np.array(u32s, np.uint32).tobytes(), np.uint8)

def mma(a_regs, b_regs):
    # a_regs[lane] = 4 u32 (u8 A), b_regs[lane] = 2 u32 (s8 B); returns c[lane][4] int
    A = np.zeros((16, 32), np.int64); B = np.zeros((32, 8), np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        ab = [bytes_of([a_regs[lane][i]]) for i in range(4)]
        for j in range(4):
            A[g, 4*t+j] = ab[0][j]; A[g+8, 4*t+j] = ab[1][j]
            A[g, 16+4*t+j] = ab[2][j]; A[g+8, 16+4*t+j] = ab[3][j]
        bb = [bytes_of([b_regs[lane][i]]).view(np.int8) for i in range(2)]
        for j in range(4):
            B[4*t+j, g] = bb[0][j]; B[16+4*t+j, g] = bb[1][j]
    C = A @ B
    return [[C[l>>2, 2*(l&3)], C[l>>2, 2*(l&3)+1], C[(l>>2)+8, 2*(l&3)], C[(l>>2)+8, 2*(l&3)+1]] for l in range(32)]

def imma(xq, xs, packed, s, b, rows, inn, out, group, bits, NT, glu):
    rows_pad = xq.shape[0]
    steps = inn // 32; per_group = group // 32
    row_bytes = inn * bits // 8
    wflat = packed.reshape(-1)
    cols = out * 2 if glu else out
    y = np.zeros((rows, out), np.float64)
    TW = 8 if glu else 16
    for bx in range((out + TW - 1) // TW):
        o = bx * TW
        for by in range(rows_pad // (8*NT)):
            r0 = by * 8 * NT
            red = np.zeros((16, 8*NT))
            for warp_kk in range(steps):  # warps' split does not change the sums
                kk = warp_kk
                a_regs, lane_sc = [], []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    if glu:
                        w0 = min(o+g, out-1); w1 = out + w0
                    else:
                        w0 = min(o+g, out-1); w1 = min(o+8+g, out-1)
                    if bits == 8:
                        pa = wflat[w0*row_bytes + 8*t + kk*32: w0*row_bytes + 8*t + kk*32 + 8]
                        pb = wflat[w1*row_bytes + 8*t + kk*32: w1*row_bytes + 8*t + kk*32 + 8]
                        p = np.frombuffer(pa.tobytes(), np.uint32); q = np.frombuffer(pb.tobytes(), np.uint32)
                        a_regs.append([p[0], q[0], p[1], q[1]])
                    else:
                        pa = wflat[w0*row_bytes + 4*t + kk*16: w0*row_bytes + 4*t + kk*16 + 4]
                        pb = wflat[w1*row_bytes + 4*t + kk*16: w1*row_bytes + 4*t + kk*16 + 4]
                        p = int(np.frombuffer(pa.tobytes(), np.uint32)[0]); q = int(np.frombuffer(pb.tobytes(), np.uint32)[0])
                        a_regs.append([p & 0x0f0f0f0f, q & 0x0f0f0f0f, (p >> 4) & 0x0f0f0f0f, (q >> 4) & 0x0f0f0f0f])
                    gi = kk // per_group
                    lane_sc.append((s[w0, gi], b[w0, gi], s[w1, gi], b[w1, gi]))
                for nt in range(NT):
                    xr = r0 + 8*nt
                    b_regs = []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        xb = xq[xr+g, 32*kk + 8*t: 32*kk + 8*t + 8]
                        u = np.frombuffer(xb.tobytes(), np.uint32)
                        b_regs.append([u[0], u[1]])
                    c = mma(a_regs, b_regs)
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        e = np.concatenate([xs[kk, xr+2*t], xs[kk, xr+2*t+1]])
                        s0, b0, s1, b1 = lane_sc[lane]
                        red[g, 8*nt+2*t] += s0*e[0]*c[lane][0] + b0*e[1]
                        red[g, 8*nt+2*t+1] += s0*e[2]*c[lane][1] + b0*e[3]
                        red[g+8, 8*nt+2*t] += s1*e[0]*c[lane][2] + b1*e[1]
                        red[g+8, 8*nt+2*t+1] += s1*e[2]*c[lane][3] + b1*e[3]
            for j in range(TW):
                for col in range(8*NT):
                    r, u = r0 + col, o + j
                    if r >= rows or u >= out: continue
                    if glu:
                        gt, up = red[j, col], red[j+8, col]
                        y[r, u] = gt / (1 + np.exp(-gt)) * up
                    else:
                        y[r, u] = red[j, col]
    return y


def kernel_reference(x, xq, xs, s, b, deq, bits, group, rows, inn):
    """x · Wᵀ as the kernel means it: int8 x times each block's scale, plus b · Σx."""
    xd = np.zeros((rows, inn))
    for r in range(rows):
        for bk in range(inn // 32):
            q = xq[r, 32 * bk:32 * bk + 32].astype(np.float64)
            if bits == 4:  # back from 0,2,4,6,1,3,5,7 to natural order
                nat = np.zeros(32)
                for j in range(4):
                    nat[8 * j:8 * j + 8:2] = q[8 * j:8 * j + 4]
                    nat[8 * j + 1:8 * j + 8:2] = q[8 * j + 4:8 * j + 8]
                q = nat
            xd[r, 32 * bk:32 * bk + 32] = q * xs[bk, r, 0]
    sc, bi = np.repeat(s, group, axis=1), np.repeat(b, group, axis=1)
    codes = np.rint((deq - bi) / sc)
    return xd @ (sc * codes).T + x.astype(np.float64) @ bi.T


def silu_glu(y, out):
    g, u = y[:, :out], y[:, out:]
    return g / (1 + np.exp(-g)) * u


def main():
    for bits, group in [(8, 32), (4, 32), (8, 64), (4, 128)]:
        for glu in (False, True):
            for rows, NT in [(3, 1), (13, 2)]:
                out, inn = (20, 256) if glu else (24, 256)
                w = rng.standard_normal((2 * out if glu else out, inn)).astype(np.float32)
                x = rng.standard_normal((rows, inn)).astype(np.float32)
                packed, s, b, deq = quantize_affine(w, bits, group)
                rows_pad = -(-rows // (8 * NT)) * 8 * NT
                xq, xs = imma_x(x, rows_pad, bits)
                y = imma(xq, xs, packed, s, b, rows, inn, out, group, bits, NT, glu)
                want = kernel_reference(x, xq, xs, s, b, deq, bits, group, rows, inn)
                f32 = x.astype(np.float64) @ deq.T.astype(np.float64)
                if glu:
                    want, f32 = silu_glu(want, out), silu_glu(f32, out)
                exact = np.abs(y - want).max() / np.abs(want).max()
                int8 = np.abs(y - f32).max() / np.abs(f32).max()
                print(f"{bits}-bit groups of {group}, {'glu' if glu else 'linear'}, {rows} rows: "
                      f"{exact:.1e} from the kernel's own product, {int8:.1e} from f32")
                assert exact < 1e-5, "the emulated kernel's indexing is off"


if __name__ == "__main__":
    main()
