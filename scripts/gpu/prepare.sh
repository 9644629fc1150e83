#!/usr/bin/env bash
# Builds everything the H200 run needs, here, and lays it out for one `run` call per
# folder (at most 64 MiB travel per call, the checkout's own ~37 MB included; the
# mlx-cuda-13 wheel alone is 90 MB, 75 MB as tar.xz, so it travels in PARTS pieces):
#   carry/a: the runtime's first part (the wheel's files as tar.xz, split), the mlx (cp312)
#            and mlx-lm wheels, the tokenizer for the random models, runtime.count
#   carry/b … : one middle part each
#   the last folder: the last part, wick (release, --features mlx, x86-64-v3, xz) and the
#            mlx_reference test binary (xz)
#   carry/gpu: these scripts (carried by every call)
# Call 1 runs stage1.sh (carry/a), the next calls copy each middle folder to the scratch
# folder (`cp carry/b/* /tmp/wick/`), the call with the last folder and later ones source
# env.sh, which joins and installs the runtime once.
# Needs: an MLX runtime here to compile against (MLX_DIR, see docs/mlx.md), pip, xz.
# TOKENIZER_DIR: a Hugging Face tokenizer folder for the random models (default: the
# Qwen2.5 tokenizer scripts/gpu/make_cpu_reference.sh extracted from the GGUF).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
MLX_VERSION=0.32.4
MLX_LM_VERSION=0.32.2
TOK=${TOKENIZER_DIR:-${WICK_HOME:-$HOME/.cache/wick}/mlx-reference/tok-qwen}
WHEELS=${WHEEL_CACHE:-$HOME/.cache/wick/wheels}
mkdir -p "$WHEELS" carry
PARTS=${PARTS:-5}
FOLDERS=(a b c d e f g h)
LAST=carry/${FOLDERS[$((PARTS - 1))]}
rm -rf carry/[a-h] carry/gpu
for ((i = 0; i < PARTS; i++)); do mkdir -p carry/${FOLDERS[$i]}; done
# The device receives the checkout its session started in, which may not be this
# branch: the scripts travel as carry/gpu too, and every call runs them from there.
cp -r scripts/gpu carry/gpu

export RUSTFLAGS="-C target-cpu=x86-64-v3"
cargo build --release --features mlx -p wick --target-dir target/gpu
cargo test --release --features mlx -p wick-engine --test mlx_reference --no-run \
  --target-dir target/gpu 2>&1 | tee target/gpu/testbuild.log
TEST_BIN=$(grep -o 'target/gpu/release/deps/mlx_reference-[0-9a-f]*' target/gpu/testbuild.log | tail -1)
strip -o $LAST/wick target/gpu/release/wick
strip -o $LAST/mlx_reference "$TEST_BIN"
xz -T0 -6 $LAST/wick $LAST/mlx_reference

if ! ls "$WHEELS"/mlx_cuda_13-$MLX_VERSION-*.whl "$WHEELS"/mlx-$MLX_VERSION-cp312-*.whl \
  "$WHEELS"/mlx_lm-$MLX_LM_VERSION-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 -d "$WHEELS" \
    "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION"
  python3 -m pip download -q --no-deps -d "$WHEELS" "mlx-lm==$MLX_LM_VERSION"
fi
CUDA_WHL=$(ls "$WHEELS"/mlx_cuda_13-$MLX_VERSION-*.whl)
RUNTIME="$WHEELS/mlx_cuda_13-$MLX_VERSION.tar.xz"
if [ ! -f "$RUNTIME" ]; then
  x=$(mktemp -d)
  (cd "$x" && unzip -q "$CUDA_WHL" && tar -cf - . | xz -T0 -6 > "$RUNTIME.tmp")
  rm -rf "$x"
  mv "$RUNTIME.tmp" "$RUNTIME"
fi
split -n $PARTS -d "$RUNTIME" carry/a/runtime.part
for ((i = 1; i < PARTS; i++)); do mv carry/a/runtime.part$(printf %02d $i) carry/${FOLDERS[$i]}/; done
echo $PARTS > carry/a/runtime.count
cp "$WHEELS"/mlx-$MLX_VERSION-cp312-*.whl "$WHEELS"/mlx_lm-$MLX_LM_VERSION-*.whl carry/a/
tar -C "$(dirname "$TOK")" -cJf carry/a/tokenizer.tar.xz "$(basename "$TOK")"
du -sh carry/*
ls -la carry/*
