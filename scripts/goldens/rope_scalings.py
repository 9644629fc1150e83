#!/usr/bin/env python3
"""Rotary scalings as transformers computes them, as a golden for wick's rope module.

For each rotary scaling (linear, llama3, yarn, longrope, dynamic) and a few parameter sets, this
writes the config object wick reads and, at several sequence lengths, the inverse frequencies
(times the position scale) and the cos/sin factor that transformers' ROPE_INIT_FUNCTIONS return
at that length (what its rotary embedding uses in a forward pass whose longest sequence has that
many tokens). The tiny-model goldens (hf_tiny_models.py) cover the short-sequence side end to
end; this covers the lengths past the trained context, where LongRoPE switches factors and
dynamic NTK grows its base.

Writes crates/wick-engine/tests/goldens/rope/rope.json, deterministically. Run in the reference
environment (scripts/goldens/regen.sh):
    target/goldens/venv/bin/python scripts/goldens/rope_scalings.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

HIDDEN, HEADS = 128, 4  # head_dim 32: 16 rotary pairs

CASES = [
    ("linear", 2048, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, [1]),
    ("llama3", 2048, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, [1]),
    ("yarn", 256, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                   "original_max_position_embeddings": 64}, [1, 1000]),
    ("yarn_mscale", 256, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                          "original_max_position_embeddings": 64, "beta_fast": 16,
                          "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.707,
                          "truncate": False}, [1]),
    ("yarn_attention_factor", 256, {"rope_type": "yarn", "rope_theta": 1000000.0,
                                    "factor": 8.0, "attention_factor": 1.25,
                                    "original_max_position_embeddings": 32}, [1]),
    ("longrope", 256, {"rope_type": "longrope", "rope_theta": 10000.0,
                       "original_max_position_embeddings": 64,
                       "short_factor": [1.0 + 0.05 * i for i in range(16)],
                       "long_factor": [1.0 + 0.4 * i for i in range(16)]}, [10, 64, 65, 200]),
    ("dynamic", 64, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
     [10, 64, 65, 300]),
]


def main() -> int:
    repo = Path(__file__).resolve().parents[2]
    out = repo / "crates" / "wick-engine" / "tests" / "goldens" / "rope" / "rope.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, max_pos, params, lengths in CASES:
        config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS,
                             max_position_embeddings=max_pos, rope_parameters=dict(params))
        points = []
        for seq_len in lengths:
            inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu",
                                                                        seq_len=seq_len)
            points.append({"seq_len": seq_len, "inv_freq": [float(v) for v in inv_freq],
                           "attention_factor": float(factor)})
        cases.append({"name": name, "dims": HIDDEN // HEADS,
                      "config": {"max_position_embeddings": max_pos,
                                 "rope_parameters": config.rope_parameters},
                      "points": points})
    doc = {"transformers": transformers.__version__, "cases": cases}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{out}: {len(cases)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
