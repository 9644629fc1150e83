#!/usr/bin/env bash
# Remakes docs/ui-chat.png and docs/ui-status.png: runs the web UI's browser tests with
# WICK_UI_SCREENSHOTS=1 (Debian's chromium, Playwright from tests/python/requirements.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt
WICK_UI_SCREENSHOTS=1 .venv/bin/python -m pytest -q tests/python/test_webui.py \
  -k "chat_streams or status_numbers or finetune_job"
ls -l docs/ui-chat.png docs/ui-status.png docs/ui-finetune.png
