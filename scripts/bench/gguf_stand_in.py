#!/usr/bin/env python3
"""A stand-in for a GGUF model where the real file cannot travel (the device machine has
no network and takes a few MiB from here): the real file's header — metadata, tokenizer,
tensor names, shapes and types — is kept, and the tensors are filled with pseudo-random
blocks of the same types whose scales are small finite numbers. Prompt and decode speed
depend on the shapes and types, not on the values, so benchmarks of the stand-in time
the same work as the real model (the text it writes is noise).

    gguf_stand_in.py header REAL.gguf HEADER      # here: the header alone (a few MiB)
    gguf_stand_in.py fill HEADER OUT.gguf         # there: header + tensors (needs numpy);
                                                  # HEADER may be xz-compressed (.xz)
"""
import os
import struct
import sys

# ggml type: (bytes per block, values per block, offsets of f16 scales in a block)
TYPES = {
    0: (4, 1, None),  # F32
    1: (2, 1, None),  # F16
    2: (18, 32, [0]),  # Q4_0
    3: (20, 32, [0, 2]),  # Q4_1
    6: (22, 32, [0]),  # Q5_0
    7: (24, 32, [0, 2]),  # Q5_1
    8: (34, 32, [0]),  # Q8_0
    10: (84, 256, [80, 82]),  # Q2_K
    11: (110, 256, [108]),  # Q3_K
    12: (144, 256, [0, 2]),  # Q4_K
    13: (176, 256, [0, 2]),  # Q5_K
    14: (210, 256, [208]),  # Q6_K
    30: (2, 1, None),  # BF16
}
# Sizes of the fixed-width GGUF value types.
SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


class Reader:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0]

    def string(self):
        n = self.take("Q")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s.decode("utf-8", "replace")

    def value(self, t):
        if t == STRING:
            return self.string()
        if t == ARRAY:
            et, n = self.take("I"), self.take("Q")
            if et == STRING:
                for _ in range(n):
                    self.string()
                return None
            self.pos += SCALAR[et] * n
            return None
        size = SCALAR[t]
        raw = self.buf[self.pos:self.pos + size]
        self.pos += size
        return int.from_bytes(raw, "little") if t in (4, 5, 10, 11) else None


def parse(buf):
    """The tensors (name, dims, type, offset) and where their data starts."""
    r = Reader(buf)
    if bytes(buf[:4]) != b"GGUF":
        sys.exit("not a GGUF file")
    r.pos = 4
    version, n_tensors, n_kv = r.take("I"), r.take("Q"), r.take("Q")
    if version < 2:
        sys.exit(f"GGUF version {version} is too old")
    align = 32
    for _ in range(n_kv):
        key, t = r.string(), r.take("I")
        v = r.value(t)
        if key == "general.alignment" and v:
            align = v
    tensors = []
    for _ in range(n_tensors):
        name, nd = r.string(), r.take("I")
        dims = [r.take("Q") for _ in range(nd)]
        t, off = r.take("I"), r.take("Q")
        tensors.append((name, dims, t, off))
    start = (r.pos + align - 1) // align * align
    return tensors, start


def nbytes(dims, t):
    if t not in TYPES:
        sys.exit(f"ggml type {t} is not known to this script")
    bb, bv, _ = TYPES[t]
    n = 1
    for d in dims:
        n *= d
    return n // bv * bb


def header(src, dst):
    with open(src, "rb") as f:
        head = f.read(64 << 20)
    _, start = parse(memoryview(head))
    with open(dst, "wb") as f:
        f.write(head[:start])
    print(f"{dst}: {start} bytes of header")


def fill(src, dst):
    import numpy as np

    if src.endswith(".xz"):
        import lzma
        head = lzma.open(src).read()
    else:
        head = open(src, "rb").read()
    tensors, start = parse(memoryview(head))
    rng = np.random.default_rng(0)
    scale = np.frombuffer(np.float16(0.0078).tobytes(), np.uint8)
    with open(dst, "wb") as f:
        f.write(head[:start])
        at = 0
        for name, dims, t, off in sorted(tensors, key=lambda x: x[3]):
            if off > at:
                f.write(b"\0" * (off - at))
                at = off
            size = nbytes(dims, t)
            bb, _, scales = TYPES[t]
            if scales is None:
                vals = rng.uniform(-0.05, 0.05, size // bb).astype(np.float32)
                if name.endswith("norm.weight"):
                    vals += 1.0
                data = {0: vals, 1: vals.astype(np.float16)}.get(t)
                if data is None:  # bf16: the high halves of the f32s
                    data = (vals.view(np.uint32) >> 16).astype(np.uint16)
                blob = data.tobytes()
            else:
                blocks = rng.integers(0, 256, (size // bb, bb), dtype=np.uint8)
                for s in scales:
                    blocks[:, s:s + 2] = scale
                blob = blocks.tobytes()
            f.write(blob)
            at += len(blob)
    print(f"{dst}: {os.path.getsize(dst)} bytes, {len(tensors)} tensors")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("header", "fill"):
        sys.exit(__doc__)
    (header if sys.argv[1] == "header" else fill)(sys.argv[2], sys.argv[3])
