#!/usr/bin/env bash
# Rebuilds every committed golden from a fresh virtual environment:
#
#   scripts/goldens/regen.sh            # then `git status` shows what changed (nothing, if the
#                                       # references and scripts are as committed)
#   scripts/goldens/regen.sh --check    # the same, and exit 1 when a golden changed
#
# Steps: a new venv in $GOLDENS_VENV (default target/goldens/venv; removed first), llama-cpp-python
# built once from source into target/goldens/wheels with $LLAMA_CMAKE_ARGS, the pinned
# requirements.txt, the models and test assets through `wick pull` (into $WICK_HOME, default
# ~/.cache/wick), then the scripts of this folder. Needs python3 (3.11 or newer) with venv,
# cargo (to build wick when target/release/wick is missing), a C++ compiler, and PyPI.
# The first run builds llama.cpp (20-40 min on 2 cores); a run after that took 22 min on a
# busy 2-core machine, most of it the llama.cpp generations.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

CHECK=0
case "${1:-}" in
  --check) CHECK=1 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
VENV=${GOLDENS_VENV:-$ROOT/target/goldens/venv}
WHEELS=${GOLDENS_WHEELS:-$ROOT/target/goldens/wheels}
LLAMA_CPP_PYTHON=0.3.36
# llama.cpp's default build targets the building CPU (GGML_NATIVE), which crashes at the first
# eval on CPUs with AMX and ties the logits to whatever CPU built it. These fixed flags (AVX-512
# with VNNI and BF16, no AMX) pick the same kernels on every CPU that has AVX-512, and reproduce
# the committed llama.cpp goldens byte for byte. A CPU without AVX-512 cannot run that build: set
# LLAMA_CMAKE_ARGS (e.g. to "-DGGML_NATIVE=OFF"); other kernels may change the logits' last digits.
LLAMA_CMAKE_ARGS=${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}
# The files the scripts below write (git pathspecs).
GOLDENS=(
  crates/wick-engine/tests/goldens
  crates/wick-chat/tests/goldens
  crates/wick-chat/tests/corpus/tool_calls/real_qwen2.5_coder.json
)

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "$PYTHON is older than Python 3.11" >&2; exit 1; }

echo "== fresh venv in $VENV"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# The wheel is kept under a name that records the flags, so changing them rebuilds it, and pip's
# own wheel cache (which ignores CMAKE_ARGS) is never used for it.
flags_id=$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-12)
wheel_dir="$WHEELS/llama-cpp-python-$LLAMA_CPP_PYTHON-$flags_id"
if ! ls "$wheel_dir"/llama_cpp_python-"$LLAMA_CPP_PYTHON"-*.whl >/dev/null 2>&1; then
  echo "== building llama-cpp-python $LLAMA_CPP_PYTHON (CMAKE_ARGS=$LLAMA_CMAKE_ARGS)"
  rm -rf "$wheel_dir.tmp"
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "${PIP[@]}" wheel --no-deps --no-cache-dir -w "$wheel_dir.tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON"
  rm -rf "$wheel_dir"
  mv "$wheel_dir.tmp" "$wheel_dir"
fi

echo "== installing scripts/goldens/requirements.txt"
"${PIP[@]}" install --no-index --no-deps "$wheel_dir"/llama_cpp_python-"$LLAMA_CPP_PYTHON"-*.whl
"${PIP[@]}" install -r scripts/goldens/requirements.txt
"${PIP[@]}" check

echo "== models and test assets"
WICK=${WICK:-$ROOT/target/release/wick}
if [ ! -x "$WICK" ]; then
  cargo build --release -p wick
fi
"$WICK" pull default qwen2.5-coder gemma3 test-assets minilm

PY="$VENV/bin/python"
run() {
  echo "== $*"
  "$PY" "$@"
}
run scripts/goldens/hf_tiny_models.py
run scripts/goldens/rope_scalings.py
run scripts/goldens/hf_tiny_gemma4.py
run scripts/goldens/hf_tiny_qwen35.py
run scripts/goldens/gguf_tiny.py
run scripts/goldens/hf_tiny_gemma3_vision.py
# The Qwen vision goldens reuse gemma3_vision's test PNGs: after it.
run scripts/goldens/hf_tiny_qwen35_vision.py
run scripts/goldens/hf_tiny_qwen25_vl.py
run scripts/goldens/hf_tiny_gemma4_vision.py
run scripts/goldens/hf_tiny_gemma4_audio.py
run scripts/goldens/media_processors.py
run scripts/goldens/hf_numpy_check.py
run scripts/goldens/peft_adapters.py
run scripts/goldens/train_parity.py
run scripts/goldens/llamacpp_greedy.py
run scripts/goldens/tokenizer_models.py
run scripts/goldens/chat_templates.py
run scripts/goldens/tool_call_qwen_coder.py
run scripts/goldens/embeddings.py

echo "== goldens that differ from the committed ones"
changed=$(git status --porcelain -- "${GOLDENS[@]}")
if [ -z "$changed" ]; then
  echo "none: every golden was rebuilt byte-identical"
else
  echo "$changed"
  git diff --stat -- "${GOLDENS[@]}"
  if [ "$CHECK" = 1 ]; then
    exit 1
  fi
fi
