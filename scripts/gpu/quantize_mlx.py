#!/usr/bin/env python3
"""Writes an MLX affine-quantized copy of a Hugging Face safetensors model, in the layout
`mlx_lm.convert -q --q-bits BITS --q-group-size GROUP` produces (U32-packed `.weight`,
`.scales` and `.biases` in the model's dtype, `quantization` in config.json), for GPU
machines without MLX. Every 2-D `*.weight` is quantized (the embedding and LM head too,
as mlx-lm does); 1-D tensors are copied.

Per group: the edge of larger magnitude (min or max) is the bias, the scale makes zero
exactly representable, values are rounded half to even — the rule of `mx.quantize` (and
of wick's `AffineWeight::quantize`). Runs on the GPU when there is one (torch).

    quantize_mlx.py SRC_DIR OUT_DIR --bits 8|4 [--group 64]
"""
import argparse
import glob
import json
import os
import shutil
import struct
import time

import torch
from safetensors import safe_open

DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def quantize(w, bits, group):
    """(packed uint8 bytes [rows, cols*bits/8], scales, biases) of a [rows, cols] matrix."""
    rows, cols = w.shape
    side = w.dtype
    g = w.float().reshape(rows, cols // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    n_bins = float((1 << bits) - 1)
    step = ((hi - lo) / n_bins).clamp_min(1e-7)
    low_edge = lo.abs() > hi.abs()
    edge = torch.where(low_edge, lo, hi)
    scale = torch.where(low_edge, step, -step)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, torch.ones_like(q0)), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    q = torch.round((g - bias[..., None]) / scale[..., None]).clamp(0, n_bins).to(torch.uint8)
    q = q.reshape(rows, cols)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return q.contiguous(), scale.to(side), bias.to(side)


def raw(t):
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.contiguous().view(torch.int16).cpu().numpy().tobytes()
    return t.contiguous().cpu().numpy().tobytes()


def write(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--bits", type=int, choices=[4, 8], required=True)
    ap.add_argument("--group", type=int, default=64)
    args = ap.parse_args()
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    shards = sorted(glob.glob(os.path.join(args.src, "*.safetensors")))
    index = {}
    for shard in shards:
        tensors = {}
        with safe_open(shard, framework="pt", device=dev) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.dim() == 2 and name.endswith(".weight") and t.shape[1] % args.group == 0:
                    q, s, b = quantize(t, args.bits, args.group)
                    rows = q.shape[0]
                    words = q.shape[1] // 4
                    tensors[name] = ("U32", (rows, words), q.cpu().numpy().tobytes())
                    module = name[: -len(".weight")]
                    tensors[module + ".scales"] = (DTYPES[s.dtype], s.shape, raw(s))
                    tensors[module + ".biases"] = (DTYPES[b.dtype], b.shape, raw(b))
                else:
                    tensors[name] = (DTYPES[t.dtype], t.shape, raw(t))
        out = os.path.join(args.out, os.path.basename(shard))
        write(out, tensors)
        index.update({n: os.path.basename(shard) for n in tensors})
    if len(shards) > 1:
        with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": index}, f)
    for extra in os.listdir(args.src):
        if extra.endswith(".safetensors") or extra.endswith(".index.json"):
            continue
        p = os.path.join(args.src, extra)
        if os.path.isfile(p):
            shutil.copy(p, args.out)
    cfg_path = os.path.join(args.out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization"] = {"group_size": args.group, "bits": args.bits}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"quantized {args.src} -> {args.out} at {args.bits} bits in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
