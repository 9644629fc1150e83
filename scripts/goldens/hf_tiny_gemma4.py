#!/usr/bin/env python3
"""Tiny random-weight Gemma 4 text models and their transformers outputs, as goldens for wick.

Two variants, written like hf_tiny_models.py's (same tokenizer, cases, file formats and helpers):

- gemma4: the e2b/e4b shape. Per-layer input embeddings (PLE), KV sharing (the last two layers
  reuse the K/V of the last sliding and the last full layer before them), sliding/full layers
  with a wider head on full layers, proportional RoPE with partial_rotary_factor 0.25 on full
  layers, the double-wide MLP of KV-shared layers, final logit soft-capping, and random
  per-layer `layer_scalar`s.
- gemma4_moe: the 26B-A4B shape. A mixture-of-experts block next to the dense MLP in every
  layer (8 experts, top 2), attention_k_eq_v (full layers use the key projection as values,
  with their own KV-head count), no PLE.

Run in the reference environment (scripts/goldens/regen.sh runs every golden script):
    target/goldens/venv/bin/python scripts/goldens/hf_tiny_gemma4.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
import tokenizers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_models as base  # noqa: E402

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]
MOE_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1000000.0},
}


def variants() -> dict:
    common = dict(
        vocab_size=base.VOCAB_SIZE, hidden_size=48, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
        rope_parameters=ROPE, max_position_embeddings=2048, rms_norm_eps=1e-6,
        final_logit_softcapping=30.0, tie_word_embeddings=True, **base.common_ids())
    return {
        "gemma4": (Gemma4ForCausalLM, Gemma4TextConfig(
            **common, num_hidden_layers=len(LAYER_TYPES), layer_types=list(LAYER_TYPES),
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=base.VOCAB_SIZE,
            num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=False)),
        "gemma4_moe": (Gemma4ForCausalLM, Gemma4TextConfig(
            **common, num_hidden_layers=len(MOE_LAYER_TYPES), layer_types=list(MOE_LAYER_TYPES),
            hidden_size_per_layer_input=0, num_kv_shared_layers=0,
            attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
            num_experts=8, top_k_experts=2, moe_intermediate_size=16)),
    }


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights as hf_tiny_models.init_weights, with Gemma 4's conventions: norm weights
    multiply directly (centred on 1, larger on the sublayer post-norms so every layer shows in
    the logits), router scales near 1, and a random layer_scalar per layer."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name or name.endswith("router.scale") or name.endswith("per_expert_scale"):
                post = ".post_attention_layernorm." in name or ".post_feedforward_layernorm" in name
                centre = 1.0 + base.GEMMA_POST_NORM_OFFSET if post else 1.0
                param.copy_(centre + base.NORM_STD * noise)
            else:
                param.copy_(base.WEIGHT_STD * noise)
        for layer in model.model.layers:
            u = torch.rand(1, generator=gen, dtype=torch.float32)
            layer.layer_scalar.copy_(0.5 + u)


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[2]
    root = repo / "crates" / "wick-engine" / "tests" / "goldens" / "hf"
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = base.build_tokenizer()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tokenizers {tokenizers.__version__}")
    # build_variant's weight initialisation and window check are Gemma 3's: swap in Gemma 4's.
    base.init_weights = lambda model, gemma_norms, seed: init_weights(model, seed)
    base.window_effect = lambda *args: {}
    for name, (cls, config) in variants().items():
        base.build_variant(name, cls, config, tokenizer, root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
