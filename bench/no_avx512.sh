# Sourced by bench/grpo_step.sh and bench/generate.sh when NO_AVX512=1: AVX-512 off in grpo and
# in the torch peer alike, as on an AVX2-only CPU (AMD Zen 2/3, many desktops and laptops).
# - grpo: a build without the `gemm-avx512` feature (candle's GEMM then has only its AVX2
#   kernels), into its own target directory, run with GRPO_ISA=avx2 (grpo's own kernels: the
#   AVX2 + FMA variants).
# - torch: ATEN_CPU_CAPABILITY=avx2 (ATen's vectorized kernels), MKL_ENABLE_INSTRUCTIONS=AVX2
#   (MKL's GEMM), ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN). The peer's JSON records
#   torch.backends.cpu.get_cpu_capability() is printed first.
if [ "${NO_AVX512:-}" = 1 ]; then
  if [ -z "${GRPO_BIN:-}" ]; then
    cargo build --release -p grpo-cli --no-default-features --target-dir "$root/target/no-avx512"
    GRPO_BIN="$root/target/no-avx512/release/grpo"
  fi
  export GRPO_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
  if [ -x "${PEERS_DIR:-/opt/peers}/venv/bin/python" ]; then
    "${PEERS_DIR:-/opt/peers}/venv/bin/python" -c \
      'import torch; print("torch CPU capability:", torch.backends.cpu.get_cpu_capability())' >&2
  fi
  echo "NO_AVX512=1: grpo $GRPO_BIN with GRPO_ISA=avx2; torch with ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2" >&2
fi
