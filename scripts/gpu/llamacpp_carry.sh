#!/usr/bin/env bash
# Makes the llama.cpp peer's carry for scripts/gpu/llamacpp.sh: a stripped copy of the
# llama.cpp vendored in llama-cpp-python's sdist, xz-compressed (~8 MB):
#   - what the CUDA build of llama-bench, llama-batched-bench and llama-quantize needs: the
#     top-level and cmake files, ggml with its CPU and CUDA backends only, src, include,
#     common, vendor (without miniaudio and stb, which only the multimodal tools use), and
#     those three tools under a tools/CMakeLists.txt that adds only them;
#   - the converter: convert_hf_to_gguf.py, conversion/, gguf-py/gguf;
#   - the vocab GGUFs that vocab_tokenizer.py turns into the tokenizers of the Llama 3,
#     Qwen and Gemma 4 shapes (qwen2, llama-bpe, gemma-4).
# No .git, tests, docs, examples or other backends.
#
#   scripts/gpu/llamacpp_carry.sh [SDIST] [OUT_DIR]
#
# SDIST: llama_cpp_python-0.3.36.tar.gz (default: the copy `wick pull` keeps in
# $WICK_HOME/downloads, ~/.cache/wick by default); OUT_DIR: default carry/llamacpp (ignored
# by git; the GPU call carries it), which receives llamacpp.tar.xz.
set -euo pipefail
SDIST=${1:-${WICK_HOME:-$HOME/.cache/wick}/downloads/llama_cpp_python-0.3.36.tar.gz}
OUT_DIR=${2:-carry/llamacpp}
[ -f "$SDIST" ] || { echo "llamacpp_carry.sh: no sdist at $SDIST" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
top=$(tar -tzf "$SDIST" | sed -n '1s|/.*||p')  # sed reads the whole list: no broken pipe
src=$top/vendor/llama.cpp
keep=(CMakeLists.txt cmake LICENSE include src common vendor
      convert_hf_to_gguf.py conversion gguf-py/gguf
      tools/llama-bench tools/batched-bench tools/quantize
      ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src
      models/ggml-vocab-qwen2.gguf models/ggml-vocab-llama-bpe.gguf
      models/ggml-vocab-gemma-4.gguf)
tar -C "$tmp" -xzf "$SDIST" "${keep[@]/#/$src/}"
L=$tmp/$src
# ggml: the CPU and CUDA backends only (each other backend's folder is added only when its
# GGML_<NAME> option is on).
for d in "$L"/ggml/src/ggml-*/; do
  case $(basename "$d") in ggml-cpu|ggml-cuda) ;; *) rm -rf "$d" ;; esac
done
rm -rf "$L/vendor/miniaudio" "$L/vendor/stb"
sed -i '/add_subdirectory(miniaudio)/d; /add_subdirectory(stb)/d' "$L/vendor/CMakeLists.txt"
cat > "$L/tools/CMakeLists.txt" <<'EOF'
# Stripped by wick's scripts/gpu/llamacpp_carry.sh: the benchmarks and the quantizer only.
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
add_subdirectory(batched-bench)
add_subdirectory(quantize)
EOF
find "$L" -name '*.md' -delete
mkdir -p "$OUT_DIR"
XZ_OPT="-9 -T${XZ_THREADS:-2}" tar -C "$tmp/$top/vendor" -cJf "$OUT_DIR/llamacpp.tar.xz" llama.cpp
echo "$OUT_DIR/llamacpp.tar.xz: $(du -k "$OUT_DIR/llamacpp.tar.xz" | cut -f1) KiB" \
     "($(du -sk "$L" | cut -f1) KiB unpacked)"
