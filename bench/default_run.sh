#!/usr/bin/env bash
# The embedded default run, 100 steps, judged by issue 35's bar: held-out greedy accuracy every
# eval_steps (best, last, step 20), the run's own health warnings (low_entropy, no_signal, ...),
# the format reward on the held-out answers, the smallest update entropy, and the wall time of
# the whole run. Run it on a quiet machine (no build, no other run) for the time to mean anything.
#   bench/default_run.sh [SEED [--key=value ...]]   # seed 42 by default; overrides make a variant
#   NAME=variant bench/default_run.sh 42 --temperature=1.0
# Results: bench/results/default-<NAME or seed>.metrics.jsonl and .summary.json, and a line on stdout.
# KEEP=dir keeps the run's output directory (checkpoints, completions) there instead of deleting it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seed=${1:-42}
shift || true
name=${NAME:-s$seed}
if [ -z "${GRPO_BIN:-}" ]; then (cd "$root" && cargo build --release -p grpo-cli); fi
grpo=${GRPO_BIN:-$root/target/release/grpo}
out=${KEEP:-$(mktemp -d)}
mkdir -p "$out"
start=$(date +%s.%N)
"$grpo" train --seed="$seed" --output_dir="$out" "$@" > "$out.log" 2>&1
wall=$(echo "$(date +%s.%N) - $start" | bc)
mkdir -p "$root/bench/results"
cp "$out/metrics.jsonl" "$root/bench/results/default-$name.metrics.jsonl"
python3 - "$out" "$wall" "$root/bench/results/default-$name.summary.json" <<'PY'
import json, os, sys
out, wall, dest = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
acc = {r["step"]: r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None}
fmt = {r["step"]: r["eval/reward/format"] for r in rows if r.get("eval/reward/format") is not None}
ent = [(r["entropy"], r["step"]) for r in rows if r.get("entropy") is not None]
health = []
if os.path.exists(f"{out}/health.jsonl"):
    health = [json.loads(l) for l in open(f"{out}/health.jsonl")]
best_step = max(acc, key=lambda s: (acc[s], -s))
last = max(acc)
s = {
    "accuracy": acc,
    "best": acc[best_step], "best_step": best_step, "last": acc[last],
    "at_20": acc.get(20),
    "format_last": fmt.get(last), "format_max": 0.1,
    "min_entropy": min(ent)[0], "min_entropy_step": min(ent)[1],
    "warnings": [f"{h['step']}: {h['kind']}" for h in health],
    "wall_s": wall,
}
json.dump(s, open(dest, "w"), indent=1)
print(f"best {s['best']:.2f} (step {best_step}), last {s['last']:.2f}, step 20 {s['at_20']}, "
      f"format {s['format_last']:.3f} of 0.1, min entropy {s['min_entropy']:.3f} (step {s['min_entropy_step']}), "
      f"warnings {s['warnings'] or 'none'}, wall {wall / 60:.1f} min")
PY
if [ -z "${KEEP:-}" ]; then rm -rf "$out"; fi
