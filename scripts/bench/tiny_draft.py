#!/usr/bin/env python3
"""Writes a draft model that is almost never right: a one-layer llama (hidden 32) with
fixed pseudo-random F32 weights and the tokenizer of a given GGUF (every `tokenizer.*`
key copied byte for byte), so `wick serve MODEL --draft-model OUT` accepts it. Used to
measure what a useless draft costs (scripts/bench/spec_ngram.py).

    python scripts/bench/tiny_draft.py ~/.cache/wick/models/smollm2-135m-instruct/*.gguf /tmp/tiny.gguf
"""
import struct
import sys
from pathlib import Path

# GGUF value types whose size is fixed.
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, U32, F32 = 8, 9, 4, 6


def skip_value(buf: bytes, at: int, kind: int) -> int:
    if kind in FIXED:
        return at + FIXED[kind]
    if kind == STRING:
        (n,) = struct.unpack_from("<Q", buf, at)
        return at + 8 + n
    if kind == ARRAY:
        item, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if item in FIXED:
            return at + FIXED[item] * count
        for _ in range(count):
            at = skip_value(buf, at, item)
        return at
    raise ValueError(f"unknown GGUF value type {kind}")


def tokenizer_entries(path: Path) -> tuple[list[bytes], int]:
    """The raw key/value records of `tokenizer.*` keys, and the vocabulary size."""
    buf = path.read_bytes()
    magic, version, _tensors, kvs = struct.unpack_from("<4sIQQ", buf, 0)
    assert magic == b"GGUF" and version == 3, (magic, version)
    at, out, vocab = 24, [], 0
    for _ in range(kvs):
        start = at
        (n,) = struct.unpack_from("<Q", buf, at)
        key = buf[at + 8:at + 8 + n].decode()
        at += 8 + n
        (kind,) = struct.unpack_from("<I", buf, at)
        at = skip_value(buf, at + 4, kind)
        if key.startswith("tokenizer."):
            out.append(buf[start:at])
        if key == "tokenizer.ggml.tokens":
            vocab = struct.unpack_from("<Q", buf, start + 8 + n + 4 + 4)[0]
    return out, vocab


def string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key: str, kind: int, value) -> bytes:
    if kind == STRING:
        return string(key) + struct.pack("<I", kind) + string(value)
    fmt = {U32: "<I", F32: "<f"}[kind]
    return string(key) + struct.pack("<I", kind) + struct.pack(fmt, value)


def weights(n: int, seed: int) -> bytes:
    # The same pattern as the Rust tests' tiny models.
    return struct.pack(f"<{n}f", *(((i * 2654435761 + seed) % 2**32 % 1000) / 5000.0 - 0.1
                                   for i in range(n)))


def main():
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    records, vocab = tokenizer_entries(source)
    h, ff, arch = 32, 64, "llama"
    meta = [
        kv("general.architecture", STRING, arch),
        kv("general.name", STRING, "tiny-draft"),
        kv(f"{arch}.block_count", U32, 1),
        kv(f"{arch}.context_length", U32, 32768),
        kv(f"{arch}.embedding_length", U32, h),
        kv(f"{arch}.feed_forward_length", U32, ff),
        kv(f"{arch}.attention.head_count", U32, 2),
        kv(f"{arch}.attention.head_count_kv", U32, 1),
        kv(f"{arch}.attention.layer_norm_rms_epsilon", F32, 1e-5),
    ] + records
    kvd = h // 2
    tensors = [
        ("token_embd.weight", [h, vocab]), ("output_norm.weight", [h]),
        ("blk.0.attn_norm.weight", [h]), ("blk.0.ffn_norm.weight", [h]),
        ("blk.0.attn_q.weight", [h, h]), ("blk.0.attn_k.weight", [h, kvd]),
        ("blk.0.attn_v.weight", [h, kvd]), ("blk.0.attn_output.weight", [h, h]),
        ("blk.0.ffn_gate.weight", [h, ff]), ("blk.0.ffn_up.weight", [h, ff]),
        ("blk.0.ffn_down.weight", [ff, h]),
    ]
    infos, data = b"", b""
    for name, dims in tensors:
        n = 1
        for d in dims:
            n *= d
        pad = (-len(data)) % 32
        data += b"\0" * pad
        infos += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        infos += struct.pack("<IQ", 0, len(data))  # F32, offset
        data += weights(n, len(name))
    head = struct.pack("<4sIQQ", b"GGUF", 3, len(tensors), len(meta)) + b"".join(meta) + infos
    head += b"\0" * ((-len(head)) % 32)
    out.write_bytes(head + data)
    print(f"wrote {out}: vocabulary {vocab}, {len(records)} tokenizer keys")


if __name__ == "__main__":
    main()
