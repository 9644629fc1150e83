#!/usr/bin/env python3
"""Makes random-weight Hugging Face models of real shapes (for benchmarks and checks).

Needs torch + transformers (both present in PyTorch's venv on the GPU machine). Weights
are drawn on the GPU when there is one (seeded), saved as safetensors in the requested
dtype, with the tokenizer files of TOKENIZER_DIR copied next to them.

    make_models.py OUT_DIR SHAPE DTYPE TOKENIZER_DIR [--seed N] [--vocab N] [--context N]

SHAPE: llama3-8b | qwen2.5-0.5b | qwen3.5-{0.8b,2b,4b} | gemma4-e4b | gemma4-26b-a4b[-6l] |
       tiny-llama | tiny-qwen2 | tiny-qwen3.5 | tiny-gemma4 | tiny-gemma4-moe
TOKENIZER_DIR: any folder of tokenizer files, e.g. one written by vocab_tokenizer.py from
       llama.cpp's vocab GGUFs (the family's real tokenizer, which llama.cpp's converter
       needs; see llamacpp.sh)
DTYPE: bfloat16 | float16 | float32
"""
import argparse
import json
import os
import shutil
import time

import torch
import transformers

def qwen35(hidden, inter, layers, heads, kv_heads, k_heads, v_heads, **extra):
    """A Qwen 3.5 text shape: blocks of three gated-DeltaNet layers and one gated attention
    layer (heads of 256, a quarter rotated), DeltaNet heads of 128, a convolution of 4
    (`extra` overrides any of it)."""
    return dict(dict(
        model_type="qwen3_5_text", hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                             partial_rotary_factor=0.25, mrope_interleaved=True,
                             mrope_section=[11, 11, 10]),
    ), **extra)


def gemma4(hidden, inter, layers, heads, kv_heads, **extra):
    """A Gemma 4 text shape (`gemma4_text`): five sliding-window layers (heads of 256) to one
    full-attention layer (heads of 512, proportional rotary over a quarter of them), the
    last layer full, a 262k vocabulary, a final logit soft cap of 30 (`extra` adds to it or
    overrides it)."""
    return dict(dict(
        model_type="gemma4_text", hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=256, global_head_dim=512, vocab_size=262144, max_position_embeddings=131072,
        rms_norm_eps=1e-6, tie_word_embeddings=True, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                     for i in range(layers - 1)] + ["full_attention"],
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                rope_theta=1000000.0)),
    ), **extra)


SHAPES = {
    # Llama-3-8B: 32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab 128256.
    "llama3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, Q/K/V biases.
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Qwen 3.5 of the 2B class.
    "qwen3.5-2b": qwen35(2048, 6144, 24, heads=8, kv_heads=2, k_heads=16, v_heads=16),
    # Qwen 3.5 of the 4B class (4.2 B parameters, 8.4 GB of bf16 read per token).
    "qwen3.5-4b": qwen35(2560, 9216, 32, heads=16, kv_heads=4, k_heads=16, v_heads=32),
    # Qwen 3.5 of the 0.8B class (CPU agent-turn measurements).
    "qwen3.5-0.8b": qwen35(1024, 3584, 24, heads=8, kv_heads=2, k_heads=16, v_heads=16),
    # Gemma 4 E4B (google/gemma-4-E4B-it's text model): 42 layers, hidden 2560, 8 heads / 2 KV
    # heads, MLP 10240, per-layer inputs of 256 a layer, the last 18 layers reading the
    # caches of earlier ones, windows of 512 (8 B parameters, 2.8 B of them the per-layer
    # table).
    "gemma4-e4b": gemma4(2560, 10240, 42, heads=8, kv_heads=2, sliding_window=512,
                         hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                         num_kv_shared_layers=18),
    # Gemma 4 26B-A4B (google/gemma-4-26B-A4B-it's text model): 30 layers, hidden 2816, 16
    # heads / 8 KV heads (2 on the full layers, whose keys are their values), a dense MLP of
    # 2112 beside 128 experts of 704 (top 8), windows of 1024, no per-layer inputs (25 B
    # parameters, 3.8 B active).
    "gemma4-26b-a4b": gemma4(2816, 2112, 30, heads=16, kv_heads=8, sliding_window=1024,
                             num_global_key_value_heads=2, attention_k_eq_v=True,
                             hidden_size_per_layer_input=0, enable_moe_block=True,
                             num_experts=128, top_k_experts=8, moe_intermediate_size=704),
    # The 26B-A4B's first six layers (five sliding, one full; 10.5 GB): its MoE prompt and
    # decode in a short call. Its tokens/s are not the whole model's.
    "gemma4-26b-a4b-6l": gemma4(2816, 2112, 6, heads=16, kv_heads=8, sliding_window=1024,
                                num_global_key_value_heads=2, attention_k_eq_v=True,
                                hidden_size_per_layer_input=0, enable_moe_block=True,
                                num_experts=128, top_k_experts=8, moe_intermediate_size=704),
    # Tiny shapes for CPU checks (CI-sized).
    "tiny-llama": dict(
        model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
        max_position_embeddings=4096, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=128, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Tiny shapes of the two families with their real vocabularies (so that the tokenizers
    # of vocab_tokenizer.py fit them): CPU checks of the llama.cpp conversion.
    "tiny-qwen3.5": qwen35(64, 128, 4, heads=4, kv_heads=2, k_heads=2, v_heads=4,
                           head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                           rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                partial_rotary_factor=0.25,
                                                mrope_interleaved=True,
                                                mrope_section=[2, 1, 1])),
    "tiny-gemma4": gemma4(64, 128, 8, heads=4, kv_heads=2, head_dim=16, global_head_dim=32,
                          sliding_window=8, hidden_size_per_layer_input=8,
                          vocab_size_per_layer_input=262144, num_kv_shared_layers=2),
    "tiny-gemma4-moe": gemma4(64, 128, 6, heads=4, kv_heads=2, head_dim=16,
                              global_head_dim=32, sliding_window=8,
                              num_global_key_value_heads=1, attention_k_eq_v=True,
                              hidden_size_per_layer_input=0, enable_moe_block=True,
                              num_experts=8, top_k_experts=2, moe_intermediate_size=32),
}


def add_legacy_rope_theta(model_dir):
    """transformers 5 writes `rope_parameters`; mlx-lm (0.32) and older readers take the
    top-level `rope_theta` and default to 10000 without it: write both."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in cfg:
        cfg["rope_theta"] = theta
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("dtype", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("tokenizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int,
                    help="vocabulary size instead of the shape's (so that a tokenizer with "
                         "more ids than the shape's vocabulary can be served)")
    ap.add_argument("--context", type=int,
                    help="max_position_embeddings instead of the shape's (long-prompt "
                         "benchmarks past Llama-3-8B's 8192)")
    ap.add_argument("--std", type=float, default=0.02,
                    help="initializer range (weights ~ N(0, std))")
    args = ap.parse_args()
    t0 = time.time()
    spec = dict(SHAPES[args.shape])
    model_type = spec.pop("model_type")
    if args.vocab:
        spec["vocab_size"] = args.vocab
    if args.context:
        spec["max_position_embeddings"] = args.context
    config = transformers.AutoConfig.for_model(model_type, **spec, initializer_range=args.std)
    config.bos_token_id = None
    config.eos_token_id = None
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    # transformers' init leaves norms at one; give them some spread so norms matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn_like(p))
    model.eval()
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True, max_shard_size="50GB")
    add_legacy_rope_theta(args.out)
    for f in os.listdir(args.tokenizer):
        if f.startswith("tokenizer") or f.endswith(".jinja") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(args.tokenizer, f), args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {args.shape} {args.dtype}, {n / 1e9:.3f} B parameters, "
          f"{time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
