#!/usr/bin/env bash
# The LMCache side environment the benchmark measures beside the project:
#   bash scripts/lmcache_env.sh        prints the environment's python, then the hiredis folder
#
# lmcache==0.5.6 from PyPI, as `pip install lmcache` leaves it (no hiredis), in a virtual
# environment of its own outside the checkout (scripts/env.sh ensure_side_env), with torch==2.14.1
# installed first: that pin takes the CUDA build kept on this machine's disk, and lmcache's own
# torch requirement is then already met, so nothing multi-GB is downloaded. hiredis goes into a
# separate folder next to it (the second line printed), which the benchmark puts on PYTHONPATH
# for its "with hiredis" rows only: one environment, a toggle for redis-py's parser.
# Built once; reruns reuse it (the stamp records the steps).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
. scripts/env.sh

LMCACHE_TORCH="torch==2.14.1"
LMCACHE_VERSION="lmcache==0.5.6"
HIREDIS_VERSION="hiredis==3.5.0"

py="$(ensure_side_env lmcache "$LMCACHE_TORCH" "$LMCACHE_VERSION")"
hiredis_dir="$LMCR_ENV_DIR/lmcache-hiredis"
if ! PYTHONPATH="$hiredis_dir" "$py" -c "import hiredis" >/dev/null 2>&1; then
    say "installing $HIREDIS_VERSION into $hiredis_dir"
    rm -rf "$hiredis_dir"
    "$py" -m pip install -q --target "$hiredis_dir" "$HIREDIS_VERSION" >&2
fi
printf '%s\n%s\n' "$py" "$hiredis_dir"
