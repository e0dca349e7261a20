# Sourced by scripts/test.sh, scripts/demo.sh and the CI scripts: creates (once) and activates a
# virtual environment outside the clone, keyed by the pinned requirements, then builds safeattn
# into it. Override the location with SAFEATTN_CACHE; choose requirements with
# SAFEATTN_REQUIREMENTS; SAFEATTN_ENV_ONLY=1 stops after activating (no build, no import).
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_reqs="${SAFEATTN_REQUIREMENTS:-$_root/requirements-dev.txt}"
_py="${PYTHON:-python3}"
_key="$("$_py" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')-$(sha256sum "$_reqs" | cut -c1-12)"
SAFEATTN_VENV="${SAFEATTN_CACHE:-$HOME/.cache/safeattn}/venv-$_key"
if [ ! -x "$SAFEATTN_VENV/bin/python" ] || [ ! -f "$SAFEATTN_VENV/.complete" ]; then
  echo "== creating $SAFEATTN_VENV from $(basename "$_reqs")"
  rm -rf "$SAFEATTN_VENV"
  "$_py" -m venv "$SAFEATTN_VENV"
  _log="$(mktemp)"
  { "$SAFEATTN_VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel &&
    "$SAFEATTN_VENV/bin/python" -m pip install -q -r "$_reqs"; } >"$_log" 2>&1 || { cat "$_log"; exit 1; }
  touch "$SAFEATTN_VENV/.complete"
fi
# shellcheck disable=SC1091
source "$SAFEATTN_VENV/bin/activate"
if [ "${SAFEATTN_ENV_ONLY:-0}" = "1" ]; then
  return 0
elif [ "${SAFEATTN_SKIP_BUILD:-0}" = "1" ]; then
  # A second environment with the same torch reuses the in-place build (python/safeattn/_C*.so).
  export PYTHONPATH="$_root/python${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "== building safeattn ($(python -c 'import torch; print("torch", torch.__version__)'))"
  _log="$(mktemp)"
  (cd "$_root" && python -m pip install -q --no-build-isolation --no-deps -e .) >"$_log" 2>&1 || { cat "$_log"; exit 1; }
fi
python -c "import safeattn" || { echo "safeattn failed to build or import" >&2; exit 1; }
