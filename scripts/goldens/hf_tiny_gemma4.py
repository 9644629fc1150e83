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

- gemma4_chat: for the server's end-to-end test of Gemma 4's chat format. The gemma4 shape with
  a tokenizer holding Gemma 4's special tokens (`<|turn>`, `<|tool_call>`, `<|channel>`, …) and
  scripted weights: every layer's output projections are zero, so each next token depends on
  the current one only, and the embedding and head are set so that greedy decoding after the
  generation prompt writes a reasoning channel, then a `get_weather` call, then `<eos>`
  (checked here with transformers' generate). The chat template is not committed: the test
  copies Gemma 4's from llama.cpp's test assets.

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
# Small enough that the cap changes the tiny models' logits (real checkpoints use 30).
FINAL_SOFTCAP = 5.0
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
        final_logit_softcapping=FINAL_SOFTCAP, tie_word_embeddings=True, **base.common_ids())
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


CHAT_SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>",
                 "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
                 "<|\"|>", "<|channel>", "<channel|>", "<|think|>"]
# Whole pieces of the scripted reply, as (non-special) added tokens.
CHAT_PIECES = ["thought\n", "The user wants the forecast.", "call:get_weather{days:3}"]
# The scripted reply: each token is followed by the next (the first follows the generation
# prompt's last token, "\n" after "<|turn>model" or the empty thought channel's close).
CHAT_SCRIPT = ["\n", "<|channel>", "thought\n", "The user wants the forecast.", "<channel|>",
               "<|tool_call>", "call:get_weather{days:3}", "<tool_call|>", "<eos>"]


def build_chat_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, AddedToken
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base.VOCAB_SIZE - len(CHAT_PIECES), min_frequency=1,
        special_tokens=CHAT_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator([base.TRAINING_TEXT] * 4, trainer=trainer)
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in CHAT_PIECES])
    if tok.get_vocab_size() != base.VOCAB_SIZE:
        raise SystemExit(f"chat tokenizer has {tok.get_vocab_size()} tokens")
    return tok


def chat_tokenizer_config() -> dict:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(CHAT_SPECIALS)
        },
        "bos_token": "<bos>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "model_max_length": 2048,
        "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


@torch.no_grad()
def build_chat_variant(root: Path) -> None:
    import json
    import shutil
    from transformers import AutoTokenizer
    name = "gemma4_chat"
    out_dir = root / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    _, gemma4 = variants()["gemma4"]
    config = Gemma4TextConfig(**{**gemma4.to_dict(), "tie_word_embeddings": False,
                                 "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2})
    tok = build_chat_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(chat_tokenizer_config(), indent=2) + "\n")
    hf_tok = AutoTokenizer.from_pretrained(out_dir)
    ids = [tok.token_to_id(t) if t != "\n" else tok.encode("\n").ids[0] for t in CHAT_SCRIPT]
    if None in ids or len(set(ids)) != len(ids):
        raise SystemExit(f"scripted tokens are not distinct single tokens: {ids}")

    torch.manual_seed(base.variant_seed(name))
    model = Gemma4ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    init_weights(model, base.variant_seed(name))
    h = config.hidden_size
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        layer.per_layer_projection.weight.zero_()
    model.model.norm.weight.fill_(1.0)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    for j, (src, dst) in enumerate(zip(ids, ids[1:])):
        embed[src].zero_()
        embed[src, j] = 1.0
        head[dst].zero_()
        head[dst, j] = 10.0
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    base.add_legacy_rope_keys(out_dir / "config.json")

    model = Gemma4ForCausalLM.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    prompt = "<bos><|turn>user\nWeather?<turn|>\n<|turn>model\n"
    prompt_ids = hf_tok(prompt, add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=12,
                         attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    got = out[0, len(prompt_ids):].tolist()
    if got != ids[1:]:
        raise SystemExit(f"scripted model wrote {hf_tok.decode(got)!r} ({got}), wanted {ids[1:]}")
    reference = {
        "variant": name,
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "scripted_ids": ids[1:],
        "scripted_text": hf_tok.decode(got, skip_special_tokens=False),
    }
    (out_dir / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"{name}: scripted reply {reference['scripted_text']!r}")


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
    build_chat_variant(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
