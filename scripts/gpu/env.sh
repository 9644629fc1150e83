#!/usr/bin/env bash
# Sourced on the H200: joins and installs the MLX wheels once (into $W/site; $W is
# $WICK_GPU_DIR, default /tmp/wick), and sets PYTHONPATH / LD_LIBRARY_PATH so that both
# wick and mlx-lm use that runtime with the CUDA 13 libraries of PyTorch's venv.
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
# The CUDA libraries PyTorch installed (the `nvidia` package next to torch).
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')} || return 1
if [ ! -f $W/site/.done ]; then
  [ -f carry/b/cudawhl.part01 ] && cp carry/b/cudawhl.part01 $W/
  [ -f $W/cudawhl.part00 ] && [ -f $W/cudawhl.part01 ] || { echo "wheel halves missing: run stage1.sh first on this machine"; return 1; }
  cat $W/cudawhl.part00 $W/cudawhl.part01 > $W/$(cat $W/cudawhl.name)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $W/site \
    $W/$(cat $W/cudawhl.name) $W/mlx-0.32.4-*.whl $W/mlx_lm-*.whl || return 1
  # libmlx.so looks for the CUDA libraries at $ORIGIN/../../nvidia/...: PyTorch's.
  ln -sfn $SP $W/site/nvidia
  for f in wick mlx_reference; do
    [ -f carry/b/$f.xz ] && xz -dc carry/b/$f.xz > $W/$f && chmod +x $W/$f
  done
  touch $W/site/.done
fi
export PYTHONPATH=$W/site
export LD_LIBRARY_PATH=$W/site/mlx/lib:$SP/cu13/lib:$SP/cudnn/lib:$SP/nccl/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
