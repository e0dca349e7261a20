#!/usr/bin/env bash
# A binary wheel (scripts/build_wheel.sh) as a user installs it: `pip install WHEEL` into a fresh
# virtual environment where no compiler can be found (PATH holds that environment's bin/ alone;
# CC, CXX and CUDA_HOME point nowhere), so the install cannot fall back to a build; then the op
# tests from a folder outside the clone (scripts/op_tests_installed.sh).
#
#   bash scripts/test_wheel.sh WHEEL [pytest args]
#
# torch and the test tools are those of `python` (PYTHON; the one the wheel was built with): the
# fresh environment sees that interpreter's site-packages through a .pth file, so pip finds the
# user's torch installed, as it would, and installs the wheel alone, without copying gigabytes of
# torch and CUDA libraries into every fresh environment. The tests run with the usual PATH back:
# torch.compile's inductor compiles its own C++ (torch's need, not the wheel's).
set -euo pipefail
cd "$(dirname "$0")/.."
wheel="$(realpath "$1")"
shift
py="$(command -v "${PYTHON:-python}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
venv="$work/venv"

t0=$SECONDS
pip=("$venv/bin/python" -m pip)
if ! "$py" -m venv "$venv" >/dev/null 2>&1; then # no ensurepip (Debian without python3-venv)
  "$py" -m venv --without-pip "$venv"
  pip=("$py" -m pip --python "$venv/bin/python")
fi
"$py" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
  >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_deps.pth"
echo "== pip install $(basename "$wheel") (fresh environment, no compiler on PATH)"
env -u CUDA_HOME -u CUDA_PATH PATH="$venv/bin" CC=/nonexistent/cc CXX=/nonexistent/c++ NVCC=/nonexistent/nvcc \
  "${pip[@]}" install -q "$wheel"
# Still no compiler: the import loads the wheel's _C as built.
env -u CUDA_HOME PATH="$venv/bin" CC=/nonexistent/cc CXX=/nonexistent/c++ \
  "$venv/bin/python" -c 'import safeattn, torch; print("imported", safeattn.__version__, "with torch", torch.__version__)'
"$venv/bin/python" -c 'from importlib.metadata import version; print("installed safeattn", version("safeattn"))'
echo "installed in $((SECONDS - t0)) s"

# The files of the sdist that the tests read: tests/, pytest's settings (pyproject.toml), and
# the generator (with the sources it checks) that one of them runs.
mkdir -p "$work/src/scripts"
cp -r tests csrc pyproject.toml "$work/src/"
cp scripts/gen_attention_instances.py "$work/src/scripts/"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
PATH="$venv/bin:$PATH" bash scripts/op_tests_installed.sh "$work/src" "$site" "$@"
