#!/usr/bin/env bash
# H200, after stage1.sh made the 0.5B model (MAKE=qwen2.5-0.5b:bfloat16), with the last carry folder:
# the bf16 noise floor on a random-weight model. The same weights upcast to f32 run by
# mlx-lm are the reference; against it: mlx-lm in bf16, and wick in bf16 with its
# own kernels and fused products on and off. Output in $OUT/precision.txt.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
source $G/env.sh || exit 1
mkdir -p $OUT $W/mlx-reference
B=$W/models/qwen2.5-0.5b-bf16
F=$W/models/qwen2.5-0.5b-f32
[ -d $F ] || python3 - $B $F <<'PY'
import json, os, shutil, sys
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1:]
os.makedirs(dst)
for f in os.listdir(src):
    p = os.path.join(src, f)
    if f.endswith(".safetensors") and "mlx_lm_reference" not in f:
        save_file({k: v.float() for k, v in load_file(p).items()}, os.path.join(dst, f),
                  metadata={"format": "pt"})
    elif f == "config.json":
        cfg = json.load(open(p))
        for k in ("torch_dtype", "dtype"):
            if k in cfg:
                cfg[k] = "float32"
        json.dump(cfg, open(os.path.join(dst, f), "w"), indent=2)
    elif os.path.isfile(p) and "mlx_lm_reference" not in f:
        shutil.copy(p, dst)
PY
python3 $G/mlx_lm_reference.py $B $B/mlx_lm_reference --steps 24 2>&1 | tail -1
python3 $G/mlx_lm_reference.py $F $F/mlx_lm_reference --steps 24 2>&1 | tail -1
python3 $G/compare_refs.py $B/mlx_lm_reference $F/mlx_lm_reference | tee -a $OUT/precision.txt
# The bf16 model's files with the f32 reference next to them.
R=$W/mlx-reference/qwen-bf16-vs-f32
mkdir -p $R
for f in $B/*; do case $f in *mlx_lm_reference*) ;; *) ln -sf $f $R/ ;; esac; done
cp $F/mlx_lm_reference.* $R/
for v in "" WICK_MLX_KERNELS=0 WICK_MLX_FUSE=0 "WICK_MLX_KERNELS=0 WICK_MLX_FUSE=0"; do
  echo "== wick bf16 ${v:-default} vs mlx-lm f32" | tee -a $OUT/precision.txt
  env $v WICK_MLX_REFERENCE_MODELS=qwen-bf16-vs-f32 timeout 120 $W/mlx_reference --ignored \
    --nocapture --test-threads 1 listed_models_match_mlx_lm 2>&1 | grep -E "vs mlx-lm|panicked at" -A1 \
    | tee -a $OUT/precision.txt
done
