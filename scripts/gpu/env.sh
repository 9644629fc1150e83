#!/usr/bin/env bash
# Sourced on the H200: joins and installs the MLX wheels once (into $W/site; $W is
# $WICK_GPU_DIR, default /tmp/wick), and sets PYTHONPATH / LD_LIBRARY_PATH so that both
# wick and mlx-lm use that runtime with the CUDA 13 libraries of PyTorch's venv.
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
# The CUDA libraries PyTorch installed (the `nvidia` package next to torch).
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')} || return 1
if [ ! -f $W/site/.done ]; then
  # The runtime came in parts (prepare.sh), carry/a's and the middle ones copied to $W
  # by earlier calls; this call's folder holds the last part and the binaries.
  for d in carry/*/; do cp $d/runtime.part* $W/ 2>/dev/null; done
  want=$(cat $W/runtime.count 2>/dev/null || echo 0)
  have=$(ls $W/runtime.part* 2>/dev/null | wc -l)
  [ "$want" -gt 0 ] && [ "$have" -eq "$want" ] \
    || { echo "runtime parts missing ($have of $want): run stage1.sh (carry/a), then copy each middle part folder, on this machine"; return 1; }
  mkdir -p $W/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $W/site \
    $W/mlx-0.32.4-*.whl $W/mlx_lm-*.whl || return 1
  # The CUDA runtime's files (libmlx.so, headers for its JIT kernels) over the mlx package.
  cat $(ls $W/runtime.part* | sort) | xz -dc | tar -C $W/site -x || return 1
  # libmlx.so looks for the CUDA libraries at $ORIGIN/../../nvidia/...: PyTorch's.
  ln -sfn $SP $W/site/nvidia
  touch $W/site/.done
fi
# The binaries of this call (a later call may bring newer ones).
for f in wick mlx_reference; do
  for x in carry/*/$f.xz; do
    [ -f "$x" ] && xz -dc "$x" > $W/$f && chmod +x $W/$f
  done
done
export PYTHONPATH=$W/site
export LD_LIBRARY_PATH=$W/site/mlx/lib:$SP/cu13/lib:$SP/cudnn/lib:$SP/nccl/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
