#!/usr/bin/env bash
# Creates the pinned router environment the cluster scripts use: a venv of its own with
# vllm-router from PyPI. Idempotent; prints the venv's path.
#   WICK_CLUSTER_VENV  where the venv goes (default: <repo>/target/cluster/venv)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${WICK_CLUSTER_VENV:-$ROOT/target/cluster/venv}"
ROUTER_PIN="vllm-router==0.1.17"
if [ ! -x "$VENV/bin/vllm-router" ] || ! "$VENV/bin/pip" show vllm-router 2>/dev/null | grep -q '^Version: 0.1.17$'; then
    python3 -m venv "$VENV" >&2
    "$VENV/bin/pip" install --quiet "$ROUTER_PIN" >&2
fi
echo "$VENV"
