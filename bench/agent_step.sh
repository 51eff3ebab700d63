#!/usr/bin/env bash
# Agents: the GRPO step with a tool that answers at once against one that takes 200 ms, on the
# default model (SmolLM2-135M-Instruct), 8 prompts x 8 episodes of up to 3 tool turns, after the
# same supervised warm-up (so that the model calls its tool). The slow tool's step should stay
# within 1.2x the fast one's: tools run while the other rows decode.
#   bench/agent_step.sh [STEPS]     # default 4 GRPO steps each; results in bench/results/agent-step-<date>.*
# Run on a quiet machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
steps=${1:-4}
stamp=$(date +%Y%m%d-%H%M%S)
res="$root/bench/results"
mkdir -p "$res"
cd "$root"
[ -n "${GRPO_BIN:-}" ] || cargo build --release -p grpo-cli
bin=${GRPO_BIN:-$root/target/release/grpo}
# Both tools are named `calculator` (same schema, same prompts): the two runs sample the same
# episodes, and only the tool's latency differs.
for tool in fast slow; do
  out=$(mktemp -d)
  "$bin" train --config examples/configs/agent_calculator.toml --output_dir="$out" \
    --tools="bench/agent_tools/$tool.py:calculator" --max_tool_calling_iterations=3 \
    --num_generations=8 --per_device_train_batch_size=64 --max_steps="$steps" \
    --sft_warmup_steps=3 --eval_steps=0 --save_strategy=no --report_to=none --threads=2 \
    > "$res/agent-step-$stamp.$tool.log" 2>&1
  cp "$out/metrics.jsonl" "$res/agent-step-$stamp.$tool.metrics.jsonl"
  rm -rf "$out"
done
python3 - "$res/agent-step-$stamp" <<'PY'
import json, statistics, sys
base = sys.argv[1]
def steps(tool):
    rows = [json.loads(l) for l in open(f"{base}.{tool}.metrics.jsonl")]
    return [r for r in rows if "time/step" in r and r.get("step", 0) > 0]
out = {}
for tool in ("fast", "slow"):
    rs = steps(tool)[1:]  # the first step warms up
    out[tool] = {
        "step_s": statistics.median(r["time/step"] for r in rs),
        "generate_s": statistics.median(r["time/generate"] for r in rs),
        "tool_calls_per_episode": statistics.mean(r.get("agent/tool_calls_per_episode", 0) for r in rs),
        "tool_seconds_per_episode": statistics.mean(r.get("agent/tool_seconds_per_episode", 0) for r in rs),
        "turns_per_episode": statistics.mean(r.get("agent/turns_per_episode", 0) for r in rs),
    }
out["slow_over_fast_step"] = out["slow"]["step_s"] / out["fast"]["step_s"]
out["slow_over_fast_generate"] = out["slow"]["generate_s"] / out["fast"]["generate_s"]
json.dump(out, open(f"{base}.summary.json", "w"), indent=1)
print(json.dumps(out, indent=1))
PY
