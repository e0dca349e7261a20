# Sourced by scripts/test.sh, scripts/demo.sh and the CI scripts: creates (once) and activates a
# virtual environment outside the clone, keyed by the pinned requirements, then builds safeattn
# into it, unless the environment's build stamp says it holds this clone's build of these sources
# with these build settings (so demo.sh after test.sh does not spend the build again: about 19
# minutes with the CUDA kernels on 2 cores). SAFEATTN_FOR_THIS_MACHINE=1 (demo.sh) builds for
# this machine's GPUs only: none, so no CUDA code, where it has none. Override the location with SAFEATTN_CACHE; choose
# requirements with SAFEATTN_REQUIREMENTS; SAFEATTN_ENV_ONLY=1 stops after activating (no build,
# no import).
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
# ccache, where installed (scripts/test.sh installs it for CI): compiled objects are kept outside
# the clone (next to the environments), keyed by the compiler, its flags and the source, so a
# build after a change recompiles only the files the change reaches. Paths inside the clone are
# hashed relative to it (a fresh clone elsewhere hits the same entries). nvcc goes
# through it by torch's PYTORCH_NVCC, the C++ compiler by ccache's compiler links on PATH.
if command -v ccache >/dev/null && [ -d /usr/lib/ccache ] && [ "${SAFEATTN_CCACHE:-1}" != "0" ]; then
  export CCACHE_DIR="${CCACHE_DIR:-${SAFEATTN_CACHE:-$HOME/.cache/safeattn}/ccache}"
  export CCACHE_BASEDIR="$_root" CCACHE_NOHASHDIR=1 CCACHE_COMPILERCHECK=content
  case ":$PATH:" in *:/usr/lib/ccache:*) ;; *) export PATH="/usr/lib/ccache:$PATH" ;; esac
  _nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  if [ -z "${PYTORCH_NVCC:-}" ] && [ -x "$_nvcc" ]; then
    export PYTORCH_NVCC="ccache $_nvcc"
  fi
fi
if [ "${SAFEATTN_ENV_ONLY:-0}" = "1" ]; then
  return 0
elif [ "${SAFEATTN_SKIP_BUILD:-0}" = "1" ]; then
  # A second environment with the same torch reuses the in-place build (python/safeattn/_C*.so).
  export PYTHONPATH="$_root/python${PYTHONPATH:+:$PYTHONPATH}"
else
  # The stamp: this clone, torch, the build settings (SAFEATTN_* but the environment's own
  # switches, TORCH_CUDA_ARCH_LIST, CUDA_HOME, the nvcc on PATH) and every file the build reads.
  # Python files are not in it: the editable install imports them from the clone.
  _build_stamp() {  # $1 = settings: the build settings are part of the stamp
    (cd "$_root" && {
      echo "$_root"
      python -c 'import torch; print(torch.__version__)'
      if [ "${1:-}" = settings ]; then
        env | grep -E '^(SAFEATTN_|TORCH_CUDA_ARCH_LIST=)' |
          grep -Ev '^SAFEATTN_(CACHE|REQUIREMENTS|ENV_ONLY|SKIP_BUILD|FOR_THIS_MACHINE)=' | LC_ALL=C sort
        echo "${CUDA_HOME:-} $(command -v nvcc || true)"
      fi
      find csrc setup.py pyproject.toml -type f | LC_ALL=C sort | xargs sha256sum
    } | sha256sum | cut -c1-32)
  }
  _stamp="$(_build_stamp settings)"
  _built="$(cat "$SAFEATTN_VENV/.build-stamp" 2>/dev/null || true)"
  # SAFEATTN_FOR_THIS_MACHINE=1 (the demo's route): any build of these sources serves (the test
  # route's included); else it builds for the GPUs this machine has, and none (no CUDA code:
  # minutes instead of about twenty on 2 cores) where it has none.
  if [ "${SAFEATTN_FOR_THIS_MACHINE:-0}" = "1" ] && [ "$_built" != "$_stamp" ]; then
    if [ "$(cat "$SAFEATTN_VENV/.build-sources" 2>/dev/null)" = "$(_build_stamp)" ]; then
      _stamp="$_built"
    elif [ -z "${SAFEATTN_CUDA:-}" ] && ! python -c 'import sys, torch; sys.exit(torch.cuda.device_count() == 0)' 2>/dev/null; then
      echo "== no GPU visible: building safeattn without CUDA kernels for this machine"
      export SAFEATTN_CUDA=0
      _stamp="$(_build_stamp settings)"
    fi
  fi
  if [ "$_built" = "$_stamp" ] && compgen -G "$_root/python/safeattn/_C*.so" >/dev/null; then
    echo "== safeattn already built from these sources (stamp $_stamp)"
  else
    echo "== building safeattn ($(python -c 'import torch; print("torch", torch.__version__)'))"
    rm -f "$SAFEATTN_VENV/.build-stamp" "$SAFEATTN_VENV/.build-sources"
    _log="$(mktemp)"
    # Objects in the tree (build/temp): ninja compiles from there, so every path ccache hashes is
    # relative to the clone (an editable install's temporary build directory would bring the
    # clone's own path into them), and a rebuild of a few files keeps the others.
    (cd "$_root" && SAFEATTN_BUILD_TEMP="${SAFEATTN_BUILD_TEMP:-$_root/build/temp}" \
      python -m pip install -q --no-build-isolation --no-deps -e .) >"$_log" 2>&1 || { cat "$_log"; exit 1; }
    python -c "import safeattn" && echo "$_stamp" >"$SAFEATTN_VENV/.build-stamp" &&
      _build_stamp >"$SAFEATTN_VENV/.build-sources"
  fi
fi
python -c "import safeattn" || { echo "safeattn failed to build or import" >&2; exit 1; }
