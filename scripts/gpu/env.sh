#!/usr/bin/env bash
# Sourced on the H200: joins and installs the MLX wheels once (into $W/site; $W is
# $WICK_GPU_DIR, default /tmp/wick), and sets PYTHONPATH / LD_LIBRARY_PATH so that both
# wick and mlx-lm use that runtime with the CUDA 13 libraries of PyTorch's venv.
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
# The CUDA libraries PyTorch installed (the `nvidia` package next to torch).
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')} || return 1
if [ ! -f $W/site/.done ]; then
  # The runtime came in three parts (prepare.sh): a and b copied to $W by earlier calls.
  for d in carry/b carry/c; do [ -d $d ] && cp $d/runtime.part* $W/ 2>/dev/null; done
  ls $W/runtime.part00 $W/runtime.part01 $W/runtime.part02 >/dev/null 2>&1 \
    || { echo "runtime parts missing: run stage1.sh (carry/a), then copy carry/b, on this machine"; return 1; }
  mkdir -p $W/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $W/site \
    $W/mlx-0.32.4-*.whl $W/mlx_lm-*.whl || return 1
  # The CUDA runtime's files (libmlx.so, headers for its JIT kernels) over the mlx package.
  cat $W/runtime.part00 $W/runtime.part01 $W/runtime.part02 | xz -dc | tar -C $W/site -x || return 1
  # libmlx.so looks for the CUDA libraries at $ORIGIN/../../nvidia/...: PyTorch's.
  ln -sfn $SP $W/site/nvidia
  for f in wick mlx_reference; do
    [ -f carry/c/$f.xz ] && xz -dc carry/c/$f.xz > $W/$f && chmod +x $W/$f
  done
  touch $W/site/.done
fi
export PYTHONPATH=$W/site
export LD_LIBRARY_PATH=$W/site/mlx/lib:$SP/cu13/lib:$SP/cudnn/lib:$SP/nccl/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
