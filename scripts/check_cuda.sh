#!/usr/bin/env bash
# Type-check the CUDA build (`--features cuda`) on a machine without a GPU or a system CUDA toolkit.
#
#   scripts/check_cuda.sh [extra cargo args...]      e.g. scripts/check_cuda.sh -p grpo
#   scripts/check_cuda.sh --skip-candle-kernels [extra cargo args...]     (what .ci/run runs)
#
# `--skip-candle-kernels` routes nvcc through scripts/nvcc_skip_candle_kernels.sh, which writes
# empty outputs for candle-kernels' own CUDA sources (15-25 minutes of nvcc on 2 cores, which a
# type check never reads) and runs the real nvcc for anything else; its target directory is
# target/cuda-typecheck. Without it, every kernel is compiled, as a real CUDA build does.
#
# What it does:
#   1. Creates a Python venv (default .ci/cuda-venv, git-ignored) and pip-installs NVIDIA's CUDA
#      compiler packages into it, pinned to one toolkit release (see CUDA_PACKAGES below). A second
#      run finds the same pins recorded in the venv and installs nothing.
#   2. Points the build at that toolkit: nvcc on PATH, CUDA_ROOT/CUDA_PATH/CUDA_HOME at its root,
#      CUDA_COMPUTE_CAP (there is no nvidia-smi to ask), and CARGO_TARGET_DIR=target/cuda-check so
#      it never takes the lock of, or invalidates, target/debug or target/release.
#   3. Runs `cargo check --workspace --all-targets --features cuda` (every workspace crate has a
#      `cuda` feature) and exits with cargo's status.
#
# Why CUDA 13 and not 12: the PyPI wheels of CUDA 12 (nvidia-cuda-nvcc-cu12, every 12.x release)
# ship only `ptxas`, not the `nvcc` driver, cudafe++ or cicc, so candle-kernels' build script (it
# compiles its .cu files to PTX and a static library with nvcc) cannot run on them. From CUDA 13,
# NVIDIA publishes the whole compiler (nvidia-cuda-nvcc + nvidia-cuda-crt + nvidia-nvvm), and all
# the wheels unpack into one toolkit tree, site-packages/nvidia/cu13/{bin,include,lib,nvvm}, so no
# symlinking is needed. cudarc 0.19 (candle's CUDA binding) supports CUDA 13.0 to 13.4; 13.0 is
# pinned. `cargo check` links nothing against the CUDA libraries (only build scripts and proc-macros
# are linked, and none of them use CUDA), so cuBLAS, cuRAND and NVRTC are not installed: the kernels
# need only nvcc, the runtime headers (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, cuda_fp8.h, mma.h)
# and CCCL (thrust, cub, cuda/std).
#
# Settings (environment):
#   CUDA_CHECK_VENV        venv directory                       (default: .ci/cuda-venv)
#   CUDA_CHECK_TARGET_DIR  cargo target directory               (default: target/cuda-check)
#   CUDA_COMPUTE_CAP       GPU architecture the kernels target  (default: 80, Ampere)
#   PYTHON                 interpreter used to create the venv  (default: python3)
#
# Needs: python3 with venv, a C++ compiler for nvcc's host side (g++), cargo, network access to PyPI
# on the first run. No root. The first run compiles candle-kernels' CUDA kernels, which takes a
# while on a small machine; later runs reuse target/cuda-check.
set -euo pipefail

# The toolkit release and its wheels (the versions the cuda-toolkit==13.0.2 meta-package pins).
CUDA_RELEASE="13.0"
CUDA_PACKAGES=(
    "nvidia-cuda-nvcc==13.0.88"    # nvcc, ptxas, fatbinary, nvlink, cudafe++
    "nvidia-cuda-crt==13.0.88"     # nvcc's own headers (include/crt)
    "nvidia-nvvm==13.0.88"         # cicc and libdevice (the CUDA C++ -> PTX front end)
    "nvidia-cuda-runtime==13.0.96" # cuda_runtime.h, cuda.h, cuda_fp16/bf16/fp8.h, libcudart
    "nvidia-cuda-cccl==13.0.85"    # thrust, cub, libcu++ (cuda/std/...)
)

log() { printf '\n==> %s\n' "$*"; }
die() { printf 'check_cuda.sh: error: %s\n' "$*" >&2; exit 1; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SKIP_CANDLE=0
if [[ "${1:-}" == "--skip-candle-kernels" ]]; then
    SKIP_CANDLE=1
    shift
fi
VENV="${CUDA_CHECK_VENV:-$ROOT/.ci/cuda-venv}"
DEFAULT_TARGET="$ROOT/target/cuda-check"
[[ $SKIP_CANDLE == 1 ]] && DEFAULT_TARGET="$ROOT/target/cuda-typecheck"
TARGET_DIR="${CUDA_CHECK_TARGET_DIR:-$DEFAULT_TARGET}"
COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
PYTHON="${PYTHON:-python3}"

command -v cargo >/dev/null || die "cargo not found on PATH"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON=...)"
command -v g++ >/dev/null || command -v c++ >/dev/null || die "no C++ compiler (g++) for nvcc's host side"

# 1. The venv and the pinned wheels. The list of pins is recorded in the venv once pip succeeds;
#    a run that finds the same list skips pip (no network needed), any change reinstalls.
STAMP="$VENV/.cuda-check-packages"
WANT="$(printf '%s\n' "${CUDA_PACKAGES[@]}")"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    log "CUDA $CUDA_RELEASE packages already installed in $VENV (reusing)"
else
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "Creating venv $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    log "Installing CUDA $CUDA_RELEASE compiler packages into $VENV: ${CUDA_PACKAGES[*]}"
    rm -f "$STAMP"
    "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input "${CUDA_PACKAGES[@]}"
    printf '%s\n' "$WANT" >"$STAMP"
fi

# 2. The toolkit tree the wheels unpacked into, and the environment the build scripts read.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
CUDA_TREE="$SITE/nvidia/cu${CUDA_RELEASE%%.*}"
for f in bin/nvcc bin/ptxas nvvm/bin/cicc include/cuda_runtime.h include/crt/host_config.h include/cccl/cub/cub.cuh; do
    [[ -e "$CUDA_TREE/$f" ]] || die "$CUDA_TREE/$f is missing: delete $VENV and run again"
done

export PATH="$CUDA_TREE/bin:$PATH"
export CUDA_ROOT="$CUDA_TREE" CUDA_PATH="$CUDA_TREE" CUDA_HOME="$CUDA_TREE"
export NVCC="$CUDA_TREE/bin/nvcc"       # cudaforge (candle-kernels' build helper) looks here first
if [[ $SKIP_CANDLE == 1 ]]; then
    export REAL_NVCC="$NVCC"
    export NVCC="$ROOT/scripts/nvcc_skip_candle_kernels.sh"
fi
export CUDA_COMPUTE_CAP="$COMPUTE_CAP"  # no nvidia-smi to ask
export CARGO_TARGET_DIR="$TARGET_DIR"

log "Toolkit: $CUDA_TREE"
"$NVCC" --version | sed -n 's/^/    /; 4p'
echo "    PATH+=$CUDA_TREE/bin"
echo "    CUDA_ROOT=CUDA_PATH=CUDA_HOME=$CUDA_TREE"
echo "    NVCC=$NVCC"
echo "    CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
echo "    CARGO_TARGET_DIR=$CARGO_TARGET_DIR"

# 3. The check. `nice` keeps it from crowding other builds on a small machine.
CMD=(cargo check --workspace --all-targets --features cuda "$@")
log "Running: ${CMD[*]}"
START=$SECONDS
status=0
nice -n 10 "${CMD[@]}" || status=$?
if [[ $status -eq 0 ]]; then
    log "CUDA check passed ($((SECONDS - START)) s)"
else
    log "CUDA check FAILED: cargo exited with $status ($((SECONDS - START)) s)"
fi
exit "$status"
