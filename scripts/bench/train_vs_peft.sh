#!/usr/bin/env bash
# scripts/bench/train_vs_peft.py in a venv with the pins of scripts/bench/requirements.txt:
#
#   scripts/bench/train_vs_peft.sh --rounds 2 --steps 8     # arguments go to the script
#
# The venv is $BENCH_VENV (default target/bench-train/venv), made on the first run (PyPI;
# torch's wheel is ~3 GB). Needs target/release/wick and the default model (`wick pull default`).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
VENV=${BENCH_VENV:-$ROOT/target/bench-train/venv}
REQ=scripts/bench/requirements.txt
if ! cmp -s "$REQ" "$VENV/.requirements.txt" 2>/dev/null; then
  echo "== venv in $VENV"
  rm -rf "$VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip --disable-pip-version-check install -q -r "$REQ"
  cp "$REQ" "$VENV/.requirements.txt"
fi
exec "$VENV/bin/python" scripts/bench/train_vs_peft.py "$@"
