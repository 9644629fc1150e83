#!/usr/bin/env bash
# H200/H100: Gemma 4 on the CUDA backend (issue 46): qwen35.sh's steps (same carry, same
# results) on a Gemma 4 shape. SHAPE: gemma4-e4b (default; 16 GB of bf16) or gemma4-26b-a4b
# (50 GB: give it a call of its own with SKIP_TEST=1, MAKE_TIMEOUT=500; its experts are
# routed on the host, so its decode is far from the target).
#  1. the Gemma 4 tests of `cuda_reference` (goldens against transformers and the CPU,
#     heads of 512, KV-shared layers), unless SKIP_TEST;
#  2. `wick bench --backend cuda`: decode after 512 tokens at batch 1 and 8, prompts of
#     PROMPTS (default 4096) tokens;
#  3. transformers eager on the same model (decode at batch 1, prompt speed), unless
#     SKIP_TORCH.
# The agent loops of qwen35.sh are skipped unless SKIP_AGENT is set empty.
export SHAPE=${SHAPE:-gemma4-e4b}
export TOK=${TOK:-crates/wick-engine/tests/goldens/hf/gemma4_chat}
export TEST_FILTER=${TEST_FILTER:-gemma4 head_size_512 shared_kv}
export PROMPTS=${PROMPTS:-4096}
export SKIP_AGENT=${SKIP_AGENT-1}
exec "$(dirname "${BASH_SOURCE[0]}")/qwen35.sh" "$@"
