#!/usr/bin/env python3
"""One short line per `wick bench --json` record read from stdin (other lines pass through):
model, case, prompt and decode tokens per second."""
import json
import sys

for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        continue
    try:
        r = json.loads(line)
    except json.JSONDecodeError:
        print(line)
        continue
    if "prompt_tps" not in r:
        print(line)
        continue
    tag = " ".join(f"{k}={r[k]}" for k in ("flash", "delta", "label") if k in r)
    print(f"{r.get('model')} {r.get('backend')} {r['prompt_tokens']}:{r['gen_tokens']}:"
          f"{r['batch']} prompt {r['prompt_tps']:.0f} tok/s decode {r['decode_tps']:.1f} tok/s"
          + (f" ({tag})" if tag else ""))
