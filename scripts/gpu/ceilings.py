#!/usr/bin/env python3
"""The two ceilings on this GPU, measured with PyTorch: device-to-device copy bandwidth
(bytes read + written per second) and the bf16 matrix-product rate (8192³, random
data). Prints one JSON object. METHOD.md of the device tool: measure both once per run.
"""
import json

import torch


def timed(fn, reps):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    dev = torch.device("cuda")
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), 20)
    copy_bw = 2 * src.numel() * 2 / t
    m = 8192
    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    t = timed(lambda: a @ b, 20)
    rate = 2 * m ** 3 / t
    print(json.dumps({
        "device": torch.cuda.get_device_name(),
        "copy_bytes_per_s": copy_bw,
        "bf16_matmul_flops": rate,
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
