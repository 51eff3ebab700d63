#!/usr/bin/env bash
# One GRPO step, grpo vs TRL GRPOTrainer, side by side in one run (same model, prompts, rewards,
# 8 prompts x 4 generations x 64 tokens, beta 0.04, dapo, lr 2e-5, f32, 2 threads).
#   bench/grpo_step.sh [STEPS [PEER_STEPS]]   # default 8 steps each (PEER_STEPS 0: grpo only); results in bench/results/grpo-step-<date>.*
#   DEVICE=cuda [BF16=1] bench/grpo_step.sh 5 5  # both on a GPU (see DEVICE below)
#   BF16=1 bench/grpo_step.sh 5 3   # CPU bf16: grpo's mixed precision and its f32 step, TRL with bf16 autocast
# Needs ../shared/bench/peers/setup.sh once (venv, f32 SmolLM2). Run on a quiet machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS_SRC:-$root/../shared/bench/peers}
PEERS_DIR=${PEERS_DIR:-/opt/peers}
steps=${1:-8}
peer_steps=${2:-$steps}
stamp=$(date +%Y%m%d-%H%M%S)
res="$root/bench/results"
mkdir -p "$res"
cd "$root"
# NO_AVX512=1: AVX-512 off in grpo and torch alike (see bench/no_avx512.sh).
. "$root/bench/no_avx512.sh"
# DEVICE=cuda: both on the GPU (grpo built with --features cuda; TRL through
# bench/trl_step_device.py, which only turns off the peer's use_cpu). BF16=1: both in bf16 mixed
# precision (grpo dtype = bf16, TRL bf16 = true). Results are named grpo-step-cuda-<date>.*
device=${DEVICE:-cpu}
dev_args=(); peer_script="$peers/trl_grpo_bench.py"; peer_args=()
if [ "$device" != cpu ]; then
  dev_args+=(--device="$device"); peer_script="$root/bench/trl_step_device.py"
  stamp="$device-$stamp"
fi
# BF16=1 on the CPU: grpo's CPU mixed precision (bf16 products where the CPU has AVX-512), its f32
# step too for the ratio, and TRL with bf16 = true (torch's CPU autocast to bf16).
f32_too=0
if [ "${BF16:-0}" = 1 ]; then
  dev_args+=(--dtype=bf16); peer_args+=(--bf16); stamp="bf16-$stamp"
  peer_script="$root/bench/trl_step_device.py"
  [ "$device" = cpu ] && f32_too=1
fi
# GRPO_BIN=path/to/grpo: measure that binary (e.g. an older build, for a before/after) instead.
if [ -z "${GRPO_BIN:-}" ]; then
  if [ "$device" != cpu ]; then cargo build --release -p grpo-cli --features cuda
  else cargo build --release -p grpo-cli; fi
fi
grpo_bin=${GRPO_BIN:-$root/target/release/grpo}
data=$(mktemp --suffix=.jsonl)
python3 "$peers/addition_task.py" $((steps * 8)) 0 > "$data"
run_grpo() { # name, extra args
  local name=$1; shift
  local out; out=$(mktemp -d)
  /usr/bin/time -v "$grpo_bin" train --config bench/configs/trl_peer.toml \
      --model="$PEERS_DIR/smollm2-135m-instruct-f32" --train_file="$data" --output_dir="$out" \
      --max_steps="$steps" "$@" 2> "$res/$name.time" | tail -3
  cp "$out/metrics.jsonl" "$res/$name.metrics.jsonl"
  rm -rf "$out"
  grep "Maximum resident" "$res/$name.time"
  python3 - "$res/$name.metrics.jsonl" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
med = lambda k: statistics.median(r[k] for r in rows)
kl = [r["kl"] for r in rows]
print(json.dumps({"bench": "grpo_step", "run": sys.argv[2], "steps": len(rows), "s_per_step_median": med("time/step"),
                  "generate": med("time/generate"), "reference": med("time/reference"),
                  "update": med("time/update"),
                  "reward_first5": statistics.mean(r["rewards/correctness/mean"] for r in rows[:5]),
                  "reward_last5": statistics.mean(r["rewards/correctness/mean"] for r in rows[-5:]),
                  "kl_last5": statistics.mean(kl[-5:]), "elapsed_s": sum(r["time/step"] for r in rows)}))
PY
}
run_grpo "grpo-step-$stamp" ${dev_args[@]+"${dev_args[@]}"}
[ "$f32_too" = 1 ] && run_grpo "grpo-step-f32-$stamp"
if [ "$peer_steps" -gt 0 ] && [ -x "$PEERS_DIR/venv/bin/python" ]; then
  /usr/bin/time -v "$PEERS_DIR/venv/bin/python" "$peer_script" --steps "$peer_steps" --prompts 8 \
      --generations 4 --max-tokens 64 --seed 0 --lr 2e-5 --beta 0.04 ${peer_args[@]+"${peer_args[@]}"} \
      2> "$res/trl-step-$stamp.time" | tee "$res/trl-step-$stamp.jsonl" | tail -2
  grep "Maximum resident" "$res/trl-step-$stamp.time"
fi
