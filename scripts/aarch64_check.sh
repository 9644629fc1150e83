#!/usr/bin/env bash
# aarch64 check: wick cross-compiles for 64-bit Arm Linux (aarch64-unknown-linux-gnu) and the
# binary runs under Debian's qemu-aarch64: it parses a tool call and generates two tokens
# greedily with the default model, which must equal this machine's own binary's tokens (the
# portable kernels are bit-identical to the x86 ones, see docs/lab/cpu-kernels.md, "Portable
# builds"). Not part of scripts/test.sh: the cross build is a second full release build
# (about 10 min on two cores). Installs, when missing: the Rust standard library for the
# target (rustup), Debian's gcc/g++ cross compilers and qemu-user. Needs the default model
# (`wick pull default`).
#
#   scripts/aarch64_check.sh [path/to/host/wick]     (default ./target/release/wick)
set -euo pipefail
cd "$(dirname "$0")/.."
host_wick=${1:-./target/release/wick}
target=aarch64-unknown-linux-gnu
sudo=""
if [ "$(id -u)" != 0 ]; then sudo=sudo; fi

if ! rustup target list --installed | grep -qx "$target"; then
  rustup target add "$target"
fi
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
    gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
cargo build --release -p wick --target "$target" --target-dir target/aarch64
wick=target/aarch64/$target/release/wick
file "$wick" 2>/dev/null || true

# The binary re-executes itself for huge pages; under qemu-user that re-exec would run the
# Arm binary natively, so it is turned off here.
emulated() { WICK_HUGE_PAGES=0 timeout 600 qemu-aarch64 -L /usr/aarch64-linux-gnu "$wick" "$@"; }
emulated --version

reply='<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
parsed=$(printf '%s' "$reply" | emulated tools parse --json)
if ! grep -q '"name": "get_weather"' <<<"$parsed"; then
  echo "aarch64 check: tools parse gave: $parsed" >&2
  exit 1
fi

prompt="The capital of France is"
args=(generate default --raw --max-tokens 2 --json --prompt "$prompt")
ids() { sed -n 's/.*"ids":\(\[[^]]*\]\).*/\1/p'; }
here=$("$host_wick" "${args[@]}" | ids)
there=$(emulated "${args[@]}" | ids)
if [ -z "$here" ] || [ "$here" != "$there" ]; then
  echo "aarch64 check: tokens differ: x86-64 $here, aarch64 $there" >&2
  exit 1
fi
echo "aarch64 check: wick builds for $target and generates the same tokens $here under qemu"
