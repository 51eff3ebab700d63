#!/usr/bin/env bash
# bitsandbytes for TRL's QLoRA peer on the GPU machine (scripts/gpu_shapes.sh, CASES=big), which
# has no network and may lack it: its wheel from PyPI, cut to the Python package and the CUDA
# 12.8 and 13.0 libraries (the full wheel, 43 MB with every CUDA, ROCm and XPU build, would push
# the tree and .gpu/ past the 64 MiB a device call carries), as .gpu/bnb.zip (~10 MB). Run after
# ../shared/gpu/pack.sh (which empties .gpu/), from the project root.
#   scripts/pack_bnb.sh [VERSION]     (default 0.50.2)
set -euo pipefail
[ -d .gpu ] || { echo "no .gpu/: run ../shared/gpu/pack.sh first" >&2; exit 1; }
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp" "bitsandbytes==${1:-0.50.2}"
python3 - "$tmp"/bitsandbytes-*.whl .gpu/bnb.zip <<'PY'
import re, sys, zipfile
src, dst = sys.argv[1:3]
keep = re.compile(r"libbitsandbytes_(cpu|cuda128|cuda130)\.so$")
with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as out:
    for i in z.infolist():
        if i.filename.endswith(".so") and not keep.search(i.filename):
            continue
        out.writestr(i, z.read(i.filename))
PY
rm -rf "$tmp"
du -sh .gpu/bnb.zip .gpu
