#!/usr/bin/env bash
# Issue 18's ablations of the embedded default run over 100 steps: each variant is the default
# config plus the overrides on its line, one run after the other (quiet machine, 2 cores; about
# 15-25 minutes each). Held-out greedy accuracy on the built-in task's 100 problems is logged every
# EVAL_STEPS steps (default 10; eval/accuracy in metrics.jsonl).
#   bench/ablations.sh [SEED [VARIANT...]]   # default seed 42, every variant
# Results: bench/results/ablation-<variant>-s<seed>.metrics.jsonl, then a table on stdout.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seed=${1:-42}
shift || true
# Each variant is the default config of before issue 18 (constant learning rate) plus its change;
# `cosine` is today's default.
c="--lr_scheduler_type=constant"
declare -A variants=(
  [baseline]="$c"
  [cosine]="--lr_scheduler_type=cosine"
  [linear]="--lr_scheduler_type=linear"
  [clip_higher]="$c --epsilon_high=0.28"
  [beta]="$c --beta=0.01"
  [entropy]="$c --entropy_coef=0.001"
  [groups16]="$c --num_generations=16"   # same 64 completions per step: 4 prompts x 16
  [dynamic]="$c --dynamic_sampling=true"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(baseline cosine linear clip_higher beta entropy groups16 dynamic)
if [ -z "${GRPO_BIN:-}" ]; then (cd "$root" && cargo build --release -p grpo-cli); fi
grpo=${GRPO_BIN:-$root/target/release/grpo}
mkdir -p "$root/bench/results"
for v in "${names[@]}"; do
  out=$(mktemp -d)
  # shellcheck disable=SC2086
  "$grpo" train --max_steps=100 --seed="$seed" --output_dir="$out" --eval_steps="${EVAL_STEPS:-10}" \
    ${variants[$v]} > "$out.log" 2>&1
  cp "$out/metrics.jsonl" "$root/bench/results/ablation-$v-s$seed.metrics.jsonl"
done
python3 - "$root/bench/results" "$seed" "${names[@]}" <<'PY'
import json, sys
res, seed, names = sys.argv[1], sys.argv[2], sys.argv[3:]
print("| variant | " + " | ".join(str(s) for s in range(0, 101, 10)) + " | best | last - best |")
print("|---" * 14 + "|")
for v in names:
    rows = [json.loads(l) for l in open(f"{res}/ablation-{v}-s{seed}.metrics.jsonl")]
    acc = {r["step"]: r["eval/accuracy"] for r in rows
           if r.get("eval/accuracy") is not None and r["step"] % 10 == 0}
    best = max(acc.values())
    last = acc[max(acc)]
    cells = [f"{acc[s]:.2f}" if s in acc else "" for s in range(0, 101, 10)]
    print(f"| {v} | " + " | ".join(cells) + f" | {best:.2f} | {last - best:+.2f} |")
PY
