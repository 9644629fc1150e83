#!/usr/bin/env python3
"""Distance between two mlx_lm_reference.py outputs (‖a − b‖ / ‖b‖ of the prompt logits,
and how many greedy tokens agree from the start): the noise floor of a precision.

    compare_refs.py A_PREFIX B_PREFIX
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file


def main():
    a, b = sys.argv[1], sys.argv[2]
    la = load_file(a + ".safetensors")["logits"].astype(np.float64)
    lb = load_file(b + ".safetensors")["logits"].astype(np.float64)
    rel = np.linalg.norm(la - lb) / np.linalg.norm(lb)
    ga, gb = json.load(open(a + ".json"))["greedy"], json.load(open(b + ".json"))["greedy"]
    same = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), len(ga))
    print(json.dumps({"a": a, "b": b, "logits_rel": rel, "greedy_same_prefix": same,
                      "steps": len(ga)}))


if __name__ == "__main__":
    main()
