#!/usr/bin/env bash
# Builds everything the H200 run needs, here, and lays it out for two `run` calls
# (at most 64 MiB travel per call; the mlx-cuda-13 wheel alone is 90 MB):
#   carry/a: first half of the mlx-cuda-13 wheel, the mlx (cp312) and mlx-lm wheels,
#            the tokenizer for the random models
#   carry/b: second half of the wheel, wick (release, --features mlx, x86-64-v3, xz) and
#            the mlx_reference test binary (xz)
#   carry/gpu: these scripts (carried by every call)
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
rm -rf carry/a carry/b carry/gpu
mkdir -p carry/a carry/b
# The device receives the checkout its session started in, which may not be this
# branch: the scripts travel as carry/gpu too, and every call runs them from there.
cp -r scripts/gpu carry/gpu

export RUSTFLAGS="-C target-cpu=x86-64-v3"
cargo build --release --features mlx -p wick --target-dir target/gpu
cargo test --release --features mlx -p wick-engine --test mlx_reference --no-run \
  --target-dir target/gpu 2>&1 | tee target/gpu/testbuild.log
TEST_BIN=$(grep -o 'target/gpu/release/deps/mlx_reference-[0-9a-f]*' target/gpu/testbuild.log | tail -1)
strip -o carry/b/wick target/gpu/release/wick
strip -o carry/b/mlx_reference "$TEST_BIN"
xz -T0 -6 carry/b/wick carry/b/mlx_reference

if ! ls "$WHEELS"/mlx_cuda_13-$MLX_VERSION-*.whl "$WHEELS"/mlx-$MLX_VERSION-cp312-*.whl \
  "$WHEELS"/mlx_lm-$MLX_LM_VERSION-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 -d "$WHEELS" \
    "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION"
  python3 -m pip download -q --no-deps -d "$WHEELS" "mlx-lm==$MLX_LM_VERSION"
fi
CUDA_WHL=$(ls "$WHEELS"/mlx_cuda_13-$MLX_VERSION-*.whl)
split -b 45M -d "$CUDA_WHL" carry/a/cudawhl.part
mv carry/a/cudawhl.part01 carry/b/
basename "$CUDA_WHL" > carry/a/cudawhl.name
cp "$WHEELS"/mlx-$MLX_VERSION-cp312-*.whl "$WHEELS"/mlx_lm-$MLX_LM_VERSION-*.whl carry/a/
tar -C "$(dirname "$TOK")" -cJf carry/a/tokenizer.tar.xz "$(basename "$TOK")"
du -sh carry/a carry/b carry/gpu
ls -la carry/a carry/b
