#!/usr/bin/env bash
# Portable-binary check: the release binary, built without target-cpu flags, runs on an
# x86-64-v2 CPU (QEMU's Nehalem model: SSE4.2, no AVX, no F16C, no FMA), so every kernel takes
# its portable path there, and it gives exactly the tokens it gives on this machine's own
# kernel family (the families are bit-identical). An instruction the model lacks would stop
# the emulated run with SIGILL. Installs Debian's qemu-user when qemu-x86_64 is missing.
# Needs the default model (`wick pull default`). About a minute on two cores.
#
#   scripts/portable_check.sh [path/to/wick]     (default ./target/release/wick)
set -euo pipefail
cd "$(dirname "$0")/.."
wick=${1:-./target/release/wick}
cpu=${PORTABLE_CPU:-Nehalem}

if [ "$(uname -m)" != x86_64 ]; then
  echo "portable check: skipped (not an x86-64 host)"
  exit 0
fi
if ! command -v qemu-x86_64 >/dev/null; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq qemu-user >/dev/null
fi

emulated() { timeout 240 qemu-x86_64 -cpu "$cpu" "$wick" "$@"; }

# The emulated CPU is x86-64-v2 and no more: glibc's loader reports the levels it finds.
levels=$(qemu-x86_64 -cpu "$cpu" /lib64/ld-linux-x86-64.so.2 --help | grep -E '^ +x86-64-v[0-9]' || true)
if ! grep -q 'x86-64-v2 (supported' <<<"$levels" || grep -q 'x86-64-v3 (supported' <<<"$levels"; then
  echo "portable check: the emulated $cpu CPU is not x86-64-v2 only:" >&2
  echo "$levels" >&2
  exit 1
fi
if ! emulated --version >/dev/null; then
  echo "portable check: wick does not start on a $cpu CPU" >&2
  exit 1
fi

# A tool-call parse: no model, exercises the CLI and the chat crate.
reply='<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
parsed=$(printf '%s' "$reply" | emulated tools parse --json)
if ! grep -q '"name": "get_weather"' <<<"$parsed"; then
  echo "portable check: tools parse on $cpu gave: $parsed" >&2
  exit 1
fi

# A short greedy generation: the quantized matrix products, attention, the sampler.
prompt="The capital of France is"
args=(generate default --raw --max-tokens 2 --json --prompt "$prompt")
ids() { sed -n 's/.*"ids":\(\[[^]]*\]\).*/\1/p'; }
here=$("$wick" "${args[@]}" | ids)
there=$(emulated "${args[@]}" | ids)
if [ -z "$here" ] || [ "$here" != "$there" ]; then
  echo "portable check: tokens differ: here $here, on $cpu $there" >&2
  exit 1
fi
echo "portable check: wick runs on a $cpu CPU (x86-64-v2) and generates the same tokens $here"
