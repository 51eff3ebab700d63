#!/usr/bin/env bash
# nvcc for `scripts/check_cuda.sh --skip-candle-kernels` (what CI runs): the real nvcc
# (`REAL_NVCC`) for everything but candle-kernels' own CUDA sources, whose outputs it writes empty.
#
# Why: `cargo check --features cuda` runs candle-kernels' build script, which compiles candle's
# ~30 .cu files (its PTX, and a static library of MoE / quantized-matmul kernels) with nvcc:
# 15-25 minutes on CI's 2 cores, more than CI's whole budget for the check. A type check needs
# none of it: the PTX is only `include_str!`-ed into candle-kernels' rlib and the static library
# is only linked, and `cargo check` runs neither. candle's kernels are candle's, compiled and tested
# upstream; grpo's own CUDA source is compiled by NVRTC at run time on the GPU and run on the CPU
# in CI by the emulator (crates/grpo-models/tests/gpu_kernels_emulated.rs).
#
# What it recognises (cudaforge 0.1's calls, from candle-kernels' build directory):
#   nvcc ... --ptx --output-directory DIR ... src/x.cu   -> DIR/x.ptx (empty)
#   nvcc ... -c -o OBJ ... src/x.cu                      -> OBJ (empty)
#   nvcc ... --lib -o LIB OBJ...                         -> LIB (an empty archive)
# Anything else, or any call from another directory, goes to the real nvcc unchanged.
set -euo pipefail
real="${REAL_NVCC:?REAL_NVCC must name the real nvcc}"
case "$PWD" in
*/candle-kernels-*) ;;
*) exec "$real" "$@" ;;
esac
args=("$@")
ptx=0 lib=0 out="" outdir="" cu=()
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
    --version | -V) exec "$real" "$@" ;;
    --ptx) ptx=1 ;;
    --lib) lib=1 ;;
    -o) out="${args[i + 1]}"; i=$((i + 1)) ;;
    --output-directory) outdir="${args[i + 1]}"; i=$((i + 1)) ;;
    *.cu) cu+=("${args[i]}") ;;
    esac
done
if [[ $ptx == 1 && -n "$outdir" && ${#cu[@]} -gt 0 ]]; then
    for f in "${cu[@]}"; do
        b="$(basename "$f" .cu)"
        printf '// %s: not compiled (scripts/nvcc_skip_candle_kernels.sh, a type check)\n' "$f" >"$outdir/$b.ptx"
    done
elif [[ $lib == 1 && -n "$out" ]]; then
    printf '!<arch>\n' >"$out"
elif [[ -n "$out" && ${#cu[@]} -gt 0 ]]; then
    : >"$out"
else
    exec "$real" "$@"
fi
