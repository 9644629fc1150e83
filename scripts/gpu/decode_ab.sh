#!/usr/bin/env bash
# H200/H100: one call that checks and measures a change to the CUDA decode step (issue 46)
# against the build before it, in the same minutes. Carry: carry/cuda/wick.xz (this build),
# carry/cuda/cuda_reference.xz and, optionally, carry/cuda/wick_prev.xz (the build before),
# built here with `--features cuda` (docs/gpu.md). Without wick_prev the A/B is this build
# with and without its decode fusions (`WICK_CUDA_DECODE_FUSIONS=0`); VARIANTS overrides
# either (prompt_ab.sh's syntax).
#  1. the whole `cuda_reference` suite (unless SKIP_TEST), while random-weight bf16 models of
#     SHAPES (make_models.py) are made with transformers on the GPU;
#  2. for each shape, prompt_ab.sh with both builds, ROUNDS interleaved rounds of CASES
#     (decode after 512 tokens at batch 1 and 8, a 4,096-token prompt);
#  3. unless SKIP_NCU, right after the first shape's A/B, one decode step of this build
#     under Nsight Compute (graphs off), summed kernel by kernel (kernel_profile.py); with
#     PROFILE_CASE (a `--case`, e.g. 4096:1:1) that case's prompt pass instead.
# Results under $OUT: test.log, <shape>.md (the A/B tables), kernels.json, steps.log, env.txt
# and details.tgz (each shape's ab.jsonl and stderr, the model makers' logs).
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
mkdir -p $W/models $OUT
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')}
export LD_LIBRARY_PATH=$SP/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
for x in carry/cuda/*.xz; do
  f=$(basename $x .xz)
  xz -dc $x > $W/$f && chmod +x $W/$f
done
if [ -f $W/wick_prev ]; then AB=${VARIANTS:-prev=wick_prev new=wick}
else AB=${VARIANTS:-unfused=wick,WICK_CUDA_DECODE_FUSIONS=0 fused=wick}; fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $OUT/env.txt 2>&1
SHAPES=${SHAPES:-gemma4-e4b qwen3.5-4b}
tokenizer() {
  case $1 in
    gemma4*) echo crates/wick-engine/tests/goldens/hf/gemma4_chat ;;
    *) echo crates/wick-engine/tests/goldens/hf/qwen2 ;;
  esac
}
(
  for s in $SHAPES; do
    [ -d $W/models/$s-bf16 ] || timeout ${MAKE_TIMEOUT:-240} python3 $G/make_models.py \
      $W/models/$s-bf16 $s bfloat16 $(tokenizer $s) > $OUT/make-$s.log 2>&1
    touch $W/models/.made-$s
  done
) &
MAKE_PID=$!
if [ -z "${SKIP_TEST:-}" ]; then
  stamp "cuda_reference"
  WICK_GOLDENS=crates/wick-engine/tests/goldens timeout ${TEST_TIMEOUT:-240} \
    $W/cuda_reference --test-threads 1 --nocapture ${TEST_FILTER:-} > $OUT/test.log 2>&1
  echo "test rc=$?" >> $OUT/test.log
  grep -E "^test |rc=|test result|panicked" $OUT/test.log | tail -40
fi
profile() {  # one decode step (or, with PROFILE_CASE, a prompt's pass) under Nsight Compute
  stamp "ncu on $1"
  local case=${PROFILE_CASE:-16:4:1} prompt=
  [ -n "${PROFILE_CASE:-}" ] && prompt=--prompt
  WICK_CUDA_GRAPHS=0 timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --print-units base --launch-count 2500 \
    $W/wick bench $W/models/$1-bf16 --backend cuda --synthetic-prompt --json --warmup 0 \
    --runs 1 --prefill-chunk 0 --case $case > $OUT/ncu.csv 2> $OUT/ncu.err
  python3 $G/kernel_profile.py $OUT/ncu.csv $1 $prompt > $OUT/kernels.json 2>> $OUT/ncu.err
  head -c 1500 $OUT/kernels.json
  rm -f $OUT/ncu.csv
}
first=${SHAPES%% *}
for s in $SHAPES; do
  stamp "waiting for $s"  # each shape's A/B starts as soon as its model is made
  while [ ! -e $W/models/.made-$s ] && kill -0 $MAKE_PID 2>/dev/null; do sleep 2; done
  [ -d $W/models/$s-bf16 ] || { stamp "no model $s"; tail -3 $OUT/make-$s.log; continue; }
  stamp "A/B on $s"
  OUT=$OUT/$s MODEL=$s-bf16 ROUNDS=${ROUNDS:-2} BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} \
    CASES=${CASES:-512:128:1 512:64:8 4096:1:1} VARIANTS="$AB" \
    bash $G/prompt_ab.sh | tee $OUT/$s.md
  # The profile follows the first shape's A/B, so a short call still gets both.
  [ "$s" = "$first" ] && [ -z "${SKIP_NCU:-}" ] && profile $s
done
stamp "done"
# The device tool returns at most 8 files: the per-run logs and JSON lines go in one archive.
( cd $OUT && tar czf details.tgz --remove-files $(ls -d */ make-*.log ncu.err 2>/dev/null) )
# Last, so the end of the output (what the device tool shows) always holds the verdict.
[ -f $OUT/test.log ] && grep -E "^test result|panicked|FAILED|rc=" $OUT/test.log
