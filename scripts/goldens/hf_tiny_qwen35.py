#!/usr/bin/env python3
"""Tiny random-weight Qwen 3.5 (`qwen3_5_text`, gated DeltaNet + full attention hybrid) models
and their transformers outputs, as goldens for wick.

Same layout and file formats as hf_tiny_models.py (whose tokenizer and helpers this reuses):
crates/wick-engine/tests/goldens/hf/<variant>/ with config.json, model.safetensors, the
tokenizer, logits.safetensors and reference.json. One extra case, `len150`, is longer than
transformers' DeltaNet chunk (64 tokens), so the chunked form's carry between chunks is checked.

Run in the reference environment (scripts/goldens/regen.sh runs it):
    target/goldens/venv/bin/python scripts/goldens/hf_tiny_qwen35.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
import tokenizers
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_models as base  # noqa: E402

LONG_CASE = 150


def variants() -> dict:
    common = dict(
        vocab_size=base.VOCAB_SIZE, hidden_size=64, intermediate_size=64,
        max_position_embeddings=2048, rms_norm_eps=1e-6, **base.common_ids())
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    return {
        # Three DeltaNet layers around one full-attention layer; DeltaNet key heads (2) serve
        # two value heads each, key dim 16 != value dim 24; full attention GQA 4/2 with
        # head_dim 32, a quarter of it rotated, output gate; untied head.
        "qwen35": Qwen3_5TextConfig(
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            layer_types=["linear_attention", "linear_attention", "full_attention",
                         "linear_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
            linear_num_key_heads=2, linear_num_value_heads=4, rope_parameters=dict(rope),
            tie_word_embeddings=False, **common),
        # Tied head, full attention first, equal DeltaNet head counts, kernel 3.
        "qwen35_tied": Qwen3_5TextConfig(
            num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            linear_conv_kernel_dim=3, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=2, rope_parameters=dict(rope),
            tie_word_embeddings=True, **common),
    }


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Large-variance random weights. Qwen 3.5's RMSNorms multiply by (1 + w), so their weights
    are centred on 0; the DeltaNet output norm multiplies by w and is centred on 1. A_log and
    dt_bias keep the decay exp(g) spread over (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + base.NORM_STD * noise)
            elif "norm" in name:
                param.copy_(base.NORM_STD * noise)
            elif name.endswith("A_log"):
                param.copy_(-0.5 + 0.5 * noise)
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * noise)
            elif "conv1d" in name:
                param.copy_(0.4 * noise)
            else:
                param.copy_(base.WEIGHT_STD * noise)


@torch.no_grad()
def chunk_consistency(model, ids: list[int]) -> float:
    """transformers' chunked prefill against its own token-by-token cached decode."""
    full = model(torch.tensor([ids]), use_cache=False).logits[0]
    out = model(torch.tensor([ids[:1]]), use_cache=True)
    cache, rows = out.past_key_values, [out.logits[0, -1]]
    for t in ids[1:]:
        out = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0, -1])
    return float((torch.stack(rows) - full).abs().max())


def build_variant(name: str, config, raw_tokenizer, root: Path) -> None:
    out_dir = root / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)

    seed = base.variant_seed(name)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM._from_config(config, attn_implementation="eager",
                                            dtype=torch.float32)
    init_weights(model, seed)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = base.save_tokenizer(raw_tokenizer, out_dir)

    model = Qwen3_5ForCausalLM.from_pretrained(out_dir, attn_implementation="eager",
                                               dtype=torch.float32)
    model.eval()

    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    long_ids = enc(base.TEXT_LONG)
    longer = enc(" ".join([base.TEXT_LONG, base.TEXT_LEN7, base.TEXT_PAIR_B, base.TEXT_LONG,
                           base.TEXT_PAIR_A, base.TEXT_LONG]))
    if len(longer) < LONG_CASE:
        raise SystemExit(f"long text has only {len(longer)} tokens")
    cases = {
        "len1": enc("The")[:1],
        "len7": enc(base.TEXT_LEN7)[:7],
        "len40": long_ids[:base.LONG_LEN],
        "pair_a": enc(base.TEXT_PAIR_A),
        "pair_b": enc(base.TEXT_PAIR_B),
        "len150": longer[:LONG_CASE],
    }

    tensors = {}
    case_meta = []
    for case_name, ids in cases.items():
        logits, hidden = base.forward_all(model, ids)
        tensors[f"{case_name}.logits"] = logits
        if case_name != "len150":
            tensors[f"{case_name}.hidden"] = hidden
        case_meta.append({"name": case_name, "ids": ids, "argmax": logits.argmax(-1).tolist(),
                          "min_top2_gap": base.top2_gap(logits)})

    checks = {
        "self_predicted_len40": sum(
            a == b for a, b in zip(cases["len40"], tensors["len40.logits"].argmax(-1).tolist())),
        "chunked_vs_recurrent_len150": chunk_consistency(model, cases["len150"]),
    }
    if checks["self_predicted_len40"] > 4:
        raise SystemExit(f"{name}: the model mostly predicts its input token; weights too weak")
    if checks["chunked_vs_recurrent_len150"] > 1e-4:
        raise SystemExit(f"{name}: transformers' chunked and recurrent forms differ: {checks}")

    prompt = tokenizer.apply_chat_template(base.GREEDY_MESSAGES, add_generation_prompt=True,
                                           tokenize=False)
    prompt_ids = enc(prompt)
    continuation, hit_eos, greedy_gap = base.greedy(model, prompt_ids)

    save_file(tensors, str(out_dir / "logits.safetensors"), metadata={"format": "pt"})
    reference = {
        "variant": name,
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "dtype": "float32",
        "attn_implementation": "eager",
        "seed": seed,
        "num_hidden_layers": config.num_hidden_layers,
        "cases": case_meta,
        "checks": checks,
        "pairs": [["pair_a", "pair_b"]],
        "greedy": {
            "prompt": prompt,
            "prompt_ids": prompt_ids,
            "max_new_tokens": base.GREEDY_NEW_TOKENS,
            "continuation_ids": continuation,
            "stopped_at_eos": hit_eos,
            "min_top2_gap": greedy_gap,
        },
        "sha256": {
            f.name: base.tensor_digest(f)
            for f in sorted(out_dir.iterdir())
            if f.suffix == ".safetensors"
        },
    }
    (out_dir / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out_dir.iterdir())
    gaps = [c["min_top2_gap"] for c in case_meta] + [greedy_gap]
    print(f"{name}: {total} bytes; min top-2 gap {min(gaps):.2e}; greedy {continuation}; "
          f"checks {checks}")


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[2]
    root = repo / "crates" / "wick-engine" / "tests" / "goldens" / "hf"
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = base.build_tokenizer()
    for name, config in variants().items():
        build_variant(name, config, tokenizer, root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
