#!/usr/bin/env bash
# Installs the pinned Claude Code and Codex CLI into target/agents (ignored by git) for
# tests/python/test_agent_clients.py. Needs npm; without it, says so and exits 0 (the tests
# then skip with that reason).
set -euo pipefail
cd "$(dirname "$0")/../.."
CLAUDE_CODE_VERSION=2.1.197
CODEX_VERSION=0.171.0
dest=target/agents
if ! command -v npm >/dev/null; then
    echo "npm not found: Claude Code and Codex CLI not installed (their tests will skip)" >&2
    exit 0
fi
mkdir -p "$dest"
have() { [ -f "$dest/node_modules/$1/package.json" ] && grep -q "\"version\": \"$2\"" "$dest/node_modules/$1/package.json"; }
if have @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION" && have @openai/codex "$CODEX_VERSION"; then
    echo "agents already installed in $dest"
    exit 0
fi
npm install --prefix "$dest" --no-audit --no-fund --no-save --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION"
"$dest/node_modules/.bin/claude" --version
"$dest/node_modules/.bin/codex" --version
