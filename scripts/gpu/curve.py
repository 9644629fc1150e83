#!/usr/bin/env python3
"""The batching curve table from batching.sh's output folder: per model and concurrency,
the server's aggregate output and steady decode rates (load tool), latency percentiles,
and the in-process greedy lockstep decode rate of the same batch size.

    curve.py OUT_DIR
"""
import json
import sys
from pathlib import Path


def lines(path: Path):
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def main() -> None:
    out = Path(sys.argv[1])
    server = lines(out / "curve.jsonl")
    lockstep = {(r["model_dir"], r["batch"]): r for r in lines(out / "lockstep.jsonl")}
    # Engine time per step during each run: differences of consecutive counter readings.
    per_step = {}
    previous = {}
    for r in lines(out / "steps.jsonl"):
        m, before = r["model_dir"], previous.get(r["model_dir"])
        previous[m] = r
        if before is None or r["steps"] == before["steps"]:
            continue
        steps = r["steps"] - before["steps"]
        per_step[(m, r["after"])] = {
            k: 1e3 * (r["seconds"][k] - before["seconds"][k]) / steps
            for k in ("total", "forward", "sampling")
        }
    print("| model | streams | temperature | output tok/s | decode tok/s (all decoding) | TTFT p50 ms "
          "| ITL p50 / p99 ms | lockstep decode tok/s | steady / lockstep "
          "| step ms: forward + sampling + rest |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in server:
        m, n, temp = r["model_dir"], r["concurrency"], r.get("temperature", 0.0)
        label = f"{n}@{temp:g}" if temp else str(n)
        lock = lockstep.get((m, n), {}).get("decode_tps") if not temp else None
        steady = r.get("steady_decode_tps") or r["decode_tps"]
        ratio = f"{steady / lock:.2f}" if lock else "–"
        lock_s = f"{lock:,.0f}" if lock else "–"
        t = per_step.get((m, label))
        split = (f"{t['forward']:.1f} + {t['sampling']:.1f} + "
                 f"{t['total'] - t['forward'] - t['sampling']:.1f}") if t else "–"
        print(f"| {m} | {n} | {temp:g} | {r['output_tps']:,.0f} | {steady:,.0f} | {r['ttft_ms']['p50']:.0f} "
              f"| {r['itl_ms']['p50']:.1f} / {r['itl_ms']['p99']:.1f} | {lock_s} | {ratio} "
              f"| {split} |")


if __name__ == "__main__":
    main()
