#!/usr/bin/env bash
# Generation throughput, grpo vs transformers `generate`, side by side in one run, f32, 2 threads.
#   bench/generate.sh            # writes bench/results/generate-<date>.jsonl and prints it (SKIP_PEER=1: grpo only)
# Needs the peer set up once: ../shared/bench/peers/setup.sh (venv + f32 SmolLM2 copy).
# Run it on a quiet machine: every row records foreign_cpu (other processes' CPU share); trust
# rows with foreign_cpu < 0.05.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS_SRC:-$root/../shared/bench/peers}
PEERS_DIR=${PEERS_DIR:-/opt/peers}
threads=${THREADS:-2}
reps=${REPS:-3}
out="$root/bench/results/generate-$(date +%Y%m%d-%H%M%S).jsonl"
mkdir -p "$root/bench/results"
cd "$root"
# NO_AVX512=1: AVX-512 off in grpo and torch alike (see bench/no_avx512.sh).
. "$root/bench/no_avx512.sh"
# GRPO_BIN=path/to/grpo: measure that binary (e.g. an older build, for a before/after) instead.
if [ -z "${GRPO_BIN:-}" ]; then cargo build --release -p grpo-cli; fi
grpo_bin=${GRPO_BIN:-$root/target/release/grpo}
prompts=$(mktemp --suffix=.jsonl)
python3 "$peers/addition_task.py" 64 0 > "$prompts"
grpo="$grpo_bin"
{
  "$grpo" --log-level warn bench gemm --threads "$threads" --reps 5
  "$grpo" --log-level warn bench generate --threads "$threads" --prompts "$prompts" \
      --shapes 1x1,8x8 --max-new-tokens 64 --reps "$reps"
  if [ -z "${SKIP_PEER:-}" ] && [ -x "$PEERS_DIR/venv/bin/python" ]; then
    "$PEERS_DIR/venv/bin/python" "$peers/gen_bench.py" --threads "$threads" \
        --batch-sizes 1,64 --max-new-tokens 64 --reps "$reps"
  else
    echo '{"bench": "hf_generate", "skipped": "run ../shared/bench/peers/setup.sh first"}'
  fi
} | tee "$out"
rm -f "$prompts"
echo "results: $out" >&2
