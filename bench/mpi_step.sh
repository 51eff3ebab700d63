#!/usr/bin/env bash
# Data parallelism on this machine: the embedded default run as 2 MPI ranks x 1 thread against
# 1 process x 2 threads, on the same global batch (64 completions = 8 prompts per step: 32 per
# rank; the default's dynamic sampling on in both). Same seeds, so the same completions; what differs is the communication (gradients
# summed over the ranks every step, episodes gathered every round) and the work each rank
# duplicates (the optimizer step, the sampler's per-step overheads, rank 0's evaluation).
#   bench/mpi_step.sh [STEPS] [ZERO_STAGES]   # default 20 steps each (eval every 5), and the
#                                 # 2 ranks at zero_stage 0 (e.g. "0 1 2": one 2-rank run per
#                                 # stage); results in bench/results/mpi-step-<date>.*
#   GRPO_BENCH_ARGS="--gradient_checkpointing=true" bench/mpi_step.sh 10 "0 2 3"
#                                 # extra flags for every run (stage 3 needs this one)
# Needs Open MPI and a build with --features mpi (done here). Run on a quiet machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
steps=${1:-20}
stages=${2:-0}
stamp=$(date +%Y%m%d-%H%M%S)
res="$root/bench/results"
mkdir -p "$res"
cd "$root"
if [ -z "${GRPO_BIN:-}" ]; then cargo build --release -p grpo-cli --features mpi; fi
grpo=${GRPO_BIN:-$root/target/release/grpo}
work=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
common=(--max_steps="$steps" --eval_steps=5 --save_steps=0 --report_to=none)
# shellcheck disable=SC2206  # word splitting wanted: several flags in one variable
extra=(${GRPO_BENCH_ARGS:-})
common+=("${extra[@]}")

t0=$(date +%s.%N)
"$grpo" train "${common[@]}" --threads=2 --per_device_train_batch_size=64 \
  --output_dir="$work/one" > "$work/one.log" 2>&1
t1=$(date +%s.%N)
walls=""
for z in $stages; do
  s0=$(date +%s.%N)
  mpirun -np 2 --bind-to core "$grpo" train "${common[@]}" --per_device_train_batch_size=32 \
    --zero_stage="$z" --output_dir="$work/two-z$z" > "$work/two-z$z.log" 2>&1
  walls="$walls $z:$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$s0" "$(date +%s.%N)")"
  cp "$work/two-z$z/metrics.jsonl" "$res/mpi-step-$stamp.two-z$z.metrics.jsonl"
done

cp "$work/one/metrics.jsonl" "$res/mpi-step-$stamp.one.metrics.jsonl"
python3 - "$work" "$t0" "$t1" "$steps" "$walls" <<'PY' | tee "$res/mpi-step-$stamp.txt"
import json, statistics, sys
work, t0, t1, steps = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
walls = dict(w.split(":") for w in sys.argv[5].split())
def rows(name):
    return [json.loads(l) for l in open(f"{work}/{name}/metrics.jsonl")]
print(f"default run, {steps} steps, 64 completions per step; wall: 1 process x 2 threads "
      f"{t1 - t0:.1f} s; 2 ranks x 1 thread " + ", ".join(f"zero_stage {z}: {w} s" for z, w in walls.items()))
for z in walls:
    two = f"two-z{z}"
    print(f"\n2 ranks at zero_stage {z}")
    print(f"{'':28}{'1 process':>12}{'2 ranks':>12}{'ratio':>8}")
    for key, label in [("time/step", "step (s, median from 2)"), ("time/generate", "generate"),
                       ("time/update", "update")]:
        a = statistics.median(r[key] for r in rows("one")[1:] if key in r)
        b = statistics.median(r[key] for r in rows(two)[1:] if key in r)
        print(f"{label:28}{a:12.2f}{b:12.2f}{b / a:8.2f}")
    acc = lambda name: {r["step"]: r["eval/accuracy"] for r in rows(name) if "eval/accuracy" in r}
    a, b = acc("one"), acc(two)
    print("held-out accuracy by step: " + ", ".join(f"{s}: {a[s]:.2f} / {b.get(s, float('nan')):.2f}" for s in sorted(a)))
PY
