#!/usr/bin/env python3
"""Facts about a model directory for the limits in docs/lab/gpu-mlx.md ("Results"): bytes a decode
step must read, parameters (for FLOPs), KV bytes per token. Prints one JSON object.

    model_facts.py MODEL_DIR [NAME]
"""
import json
import os
import struct
import sys


def tensors(model_dir):
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if not f.endswith(".safetensors") or f.startswith("mlx_lm_reference"):
            continue
        with open(os.path.join(model_dir, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                out[name] = b - a
    return out


def main():
    model_dir = sys.argv[1]
    name = sys.argv[2] if len(sys.argv) > 2 else os.path.basename(model_dir.rstrip("/"))
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    sizes = tensors(model_dir)
    total = sum(sizes.values())
    embed = sum(v for k, v in sizes.items() if "embed_tokens" in k)
    tied = cfg.get("tie_word_embeddings", False) or not any("lm_head" in k for k in sizes)
    # A decode step reads every matrix once; the embedding table only one row, unless it
    # is also the output head.
    decode_bytes = total if tied else total - embed
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    ffn, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    layer_params = h * heads * hd + 2 * h * kvh * hd + heads * hd * h + 3 * h * ffn
    print(json.dumps({
        "name": name,
        "total_bytes": total,
        "decode_bytes": decode_bytes,
        "layers": layers,
        "hidden": h,
        "heads": heads,
        "kv_heads": kvh,
        "head_dim": hd,
        "layer_params": layer_params,
        "body_params": layers * layer_params,
        "head_params": vocab * h,
        "kv_bytes_per_token": layers * 2 * kvh * hd * 2,
        "quantization": cfg.get("quantization"),
    }))


if __name__ == "__main__":
    main()
