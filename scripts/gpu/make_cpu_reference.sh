#!/usr/bin/env bash
# Makes the MLX-on-CPU reference set the `mlx_reference` test reads, under
# $WICK_HOME/mlx-reference (default ~/.cache/wick/mlx-reference):
#   smollm2-135m-bf16    real SmolLM2 weights (from the GGUF, via transformers) in bf16
#   smollm2-135m-4bit    the same, quantized by mlx_lm.convert: affine 4-bit, group 64
#   smollm2-135m-mixed   mlx_lm.convert --quant-predicate mixed_4_6 (per-layer overrides)
#   tiny-qwen2-f32       random weights, Qwen2 shape (Q/K/V biases), float32
#   tiny-qwen2-8bit      the same quantized to affine 8-bit, group 32
# each with mlx_lm_reference.{json,safetensors}: mlx-lm's logits and greedy tokens on CPU.
#
# TORCH_PY: a python with torch, transformers, gguf and accelerate (reads the GGUF,
#           makes models).
# MLX_PY:   a python with mlx==0.32.4, mlx-cpu==0.32.4, mlx-lm==0.32.2.
# Needs `wick pull smollm2-135m-instruct` and `wick pull qwen2.5-coder-0.5b-instruct`.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
HOME_DIR=${WICK_HOME:-$HOME/.cache/wick}
OUT=$HOME_DIR/mlx-reference
TORCH_PY=${TORCH_PY:-python3}
MLX_PY=${MLX_PY:-python3}
mkdir -p "$OUT"
SMOL=$HOME_DIR/models/smollm2-135m-instruct
QWEN=$HOME_DIR/models/qwen2.5-coder-0.5b-instruct

"$TORCH_PY" - "$SMOL" "$QWEN" "$OUT" "$HERE" <<'PY'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
smol, qwen, out, here = sys.argv[1:]
for name, d, f in [("tok-smollm", smol, "SmolLM2-135M-Instruct.Q4_1.gguf"),
                   ("tok-qwen", qwen, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")]:
    t = AutoTokenizer.from_pretrained(d, gguf_file=f)
    t.save_pretrained(os.path.join(out, name))
dst = os.path.join(out, "smollm2-135m-bf16")
if not os.path.isdir(dst):
    # transformers dequantizes the GGUF (and undoes llama.cpp's Q/K row order); it cannot
    # save a GGUF-backed model, so write the dequantized state dict ourselves.
    from safetensors.torch import save_file
    m = AutoModelForCausalLM.from_pretrained(smol, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                             dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.torch_dtype = "bfloat16"
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in m.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    os.makedirs(dst)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(dst)
    sys.path.insert(0, here)
    from make_models import add_legacy_rope_theta
    add_legacy_rope_theta(dst)
    AutoTokenizer.from_pretrained(os.path.join(out, "tok-smollm")).save_pretrained(dst)
PY

[ -d "$OUT/tiny-qwen2-f32" ] || "$TORCH_PY" "$HERE/make_models.py" "$OUT/tiny-qwen2-f32" tiny-qwen2 float32 "$OUT/tok-qwen" --seed 1 --std 0.08

convert() { # SRC DST ARGS...
  local src=$1 dst=$2; shift 2
  [ -d "$dst" ] || "$MLX_PY" -m mlx_lm convert --hf-path "$src" --mlx-path "$dst" "$@"
}
convert "$OUT/smollm2-135m-bf16" "$OUT/smollm2-135m-4bit" -q --q-bits 4 --q-group-size 64
convert "$OUT/smollm2-135m-bf16" "$OUT/smollm2-135m-mixed" -q --quant-predicate mixed_4_6
convert "$OUT/tiny-qwen2-f32" "$OUT/tiny-qwen2-8bit" -q --q-bits 8 --q-group-size 32

for m in smollm2-135m-bf16 smollm2-135m-4bit smollm2-135m-mixed tiny-qwen2-f32 tiny-qwen2-8bit; do
  "$MLX_PY" "$HERE/mlx_lm_reference.py" "$OUT/$m" "$OUT/$m/mlx_lm_reference" --cpu --steps 24
done
echo "reference set in $OUT"
