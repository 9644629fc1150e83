#!/usr/bin/env python3
"""Independent check of the tiny-model goldens: a float64 numpy forward pass written only from
config.json, model.safetensors and the conventions in scripts/goldens/README.md, compared with
the transformers logits and hidden states in logits.safetensors.

If this passes, the README describes everything an engine needs to reproduce the goldens.

    target/goldens/venv/bin/python scripts/goldens/hf_numpy_check.py   # the venv scripts/goldens/regen.sh makes
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2] / "crates" / "wick-engine" / "tests" / "goldens" / "hf"
LOGIT_TOLERANCE = 1e-4


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: bool) -> np.ndarray:
    """RMSNorm over the last axis; Gemma multiplies by (1 + w), the others by w."""
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * ((1.0 + weight) if offset else weight)


def rotary(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding in the split-halves layout: dims i and i + D/2 form a pair."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (np.arange(half) * 2.0 / x.shape[-1])
    angles = np.concatenate([positions[:, None] * inv_freq] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class TinyModel:
    def __init__(self, directory: Path):
        self.config = json.loads((directory / "config.json").read_text())
        weights = load_file(str(directory / "model.safetensors"))
        self.w = {name: array.astype(np.float64) for name, array in weights.items()}
        self.gemma = self.config["model_type"] == "gemma3_text"

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def forward(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        c, w, gemma = self.config, self.w, self.gemma
        layers = c["num_hidden_layers"]
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        eps = c["rms_norm_eps"]
        layer_types = c.get("layer_types") or ["full_attention"] * layers
        seq = len(ids)
        positions = np.arange(seq, dtype=np.float64)

        x = w["model.embed_tokens.weight"][np.array(ids)]
        if gemma:
            x = x * np.sqrt(c["hidden_size"])
        stream = [x]
        for i in range(layers):
            p = f"model.layers.{i}."
            sliding = layer_types[i] == "sliding_attention"
            h = rms_norm(x, w[p + "input_layernorm.weight"], eps, gemma)
            q = self.linear(p + "self_attn.q_proj", h).reshape(seq, heads, head_dim)
            k = self.linear(p + "self_attn.k_proj", h).reshape(seq, kv_heads, head_dim)
            v = self.linear(p + "self_attn.v_proj", h).reshape(seq, kv_heads, head_dim)
            if p + "self_attn.q_norm.weight" in w:
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps, gemma)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps, gemma)
            theta = c["rope_local_base_freq"] if (gemma and sliding) else c["rope_theta"]
            q, k = rotary(q, positions, theta), rotary(k, positions, theta)
            k = np.repeat(k, heads // kv_heads, axis=1)
            v = np.repeat(v, heads // kv_heads, axis=1)
            scale = c["query_pre_attn_scalar"] ** -0.5 if gemma else head_dim**-0.5
            scores = np.einsum("qhd,khd->hqk", q, k) * scale
            query, key = np.arange(seq)[:, None], np.arange(seq)[None, :]
            visible = key <= query
            if sliding:
                visible &= key > query - c["sliding_window"]
            scores = np.where(visible[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(seq, heads * head_dim)
            attn = self.linear(p + "self_attn.o_proj", attn)
            if gemma:
                x = x + rms_norm(attn, w[p + "post_attention_layernorm.weight"], eps, True)
                h = rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], eps, True)
            else:
                x = x + attn
                h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps, False)
            act = gelu_tanh if gemma else silu
            mlp = act(self.linear(p + "mlp.gate_proj", h)) * self.linear(p + "mlp.up_proj", h)
            mlp = self.linear(p + "mlp.down_proj", mlp)
            if gemma:
                mlp = rms_norm(mlp, w[p + "post_feedforward_layernorm.weight"], eps, True)
            x = x + mlp
            stream.append(x)
        x = rms_norm(x, w["model.norm.weight"], eps, gemma)
        stream.append(x)
        lm_head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return x @ lm_head.T, np.stack(stream)


def main() -> int:
    failed = False
    for directory in sorted(d for d in ROOT.iterdir() if d.is_dir()):
        # Qwen 3.5's DeltaNet hybrid is not modelled here; hf_tiny_qwen35.py cross-checks
        # transformers' chunked form against its token-by-token recurrence instead.
        if json.loads((directory / "config.json").read_text()).get("model_type") == "qwen3_5_text":
            continue
        model = TinyModel(directory)
        golden = load_file(str(directory / "logits.safetensors"))
        reference = json.loads((directory / "reference.json").read_text())
        worst_logit = worst_hidden = 0.0
        for case in reference["cases"]:
            logits, hidden = model.forward(case["ids"])
            worst_logit = max(worst_logit, float(np.abs(logits - golden[case["name"] + ".logits"]).max()))
            worst_hidden = max(worst_hidden, float(np.abs(hidden - golden[case["name"] + ".hidden"]).max()))
            if logits.argmax(-1).tolist() != case["argmax"]:
                print(f"{directory.name}/{case['name']}: argmax differs")
                failed = True
        ok = worst_logit <= LOGIT_TOLERANCE
        failed |= not ok
        print(f"{directory.name}: max |logit diff| {worst_logit:.2e}, max |hidden diff| "
              f"{worst_hidden:.2e} {'ok' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
