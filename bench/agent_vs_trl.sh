#!/usr/bin/env bash
# Agents: grpo's GRPO step against TRL's GRPOTrainer with the same `tools=` (issue 56), from the
# same start weights, on the same prompts, in the same shape: SmolLM2-135M-Instruct, the calculator
# of bench/agent_tools/fast.py, examples/templates/chatml_tools.jinja, 8 prompts x 8 episodes of up
# to 3 tool turns (bench/agent_step.sh's shape), lr 1e-5 cosine, dapo, beta 0, 2 threads.
#   bench/agent_vs_trl.sh [STEPS [PEER_STEPS]]   # default 4 and 4; results in bench/results/agent-vs-trl-<date>.*
# Run on a quiet machine. Needs the peer venv (../shared/bench/peers/setup.sh).
#
# 1. The start weights: grpo's supervised warm-up (3 steps of 64 traces, bench/agent_step.sh's),
#    saved as an HF checkpoint. grpo cannot stop after the warm-up alone (max_steps >= 1), so the
#    run takes one GRPO step at learning rate 1e-30 (no change to any weight) over 8-token turns
#    (cheap) and saves it. START=dir skips this and starts both from that HF directory.
# 2. grpo's agent step from that checkpoint (no warm-up), logging every episode, so that
# 3. TRL gets the prompts grpo sampled, step by step (bench/trl_agent_step.py --prompts-file),
#    starting from the same checkpoint, in bf16 mixed precision when grpo's dtype = auto took bf16.
# 4. A summary: each side's median step and generation seconds (from the second step on), tool
#    calls and turns per episode, and TRL's over grpo's.
# Environment: GRPO_BIN (a built binary; unset: cargo build --release), PEERS_DIR (/opt/peers),
# PYTHON (the peer venv's python), MODEL (the base of the warm-up; default the peer's f32 copy),
# THREADS (2), PROMPTS and GENERATIONS (8 and 8: a smaller shape for a quick check), TOOL (fast
# or slow), GRPO_ARGS (more grpo flags, e.g.
# "--drop_zero_std_groups=false" for the same update work as TRL), TRL_ARGS (more flags of
# bench/trl_agent_step.py, e.g. "--quiet-threshold 0"), RESULTS (bench/results), START (see 1).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
steps=${1:-4}
peer_steps=${2:-$steps}
PEERS_DIR=${PEERS_DIR:-/opt/peers}
py=${PYTHON:-$PEERS_DIR/venv/bin/python}
model=${MODEL:-$PEERS_DIR/smollm2-135m-instruct-f32}
threads=${THREADS:-2}
prompts=${PROMPTS:-8}
gens=${GENERATIONS:-8}
tool="bench/agent_tools/${TOOL:-fast}.py:calculator"
stamp=$(date +%Y%m%d-%H%M%S)
res=${RESULTS:-$root/bench/results}
base="$res/agent-vs-trl-$stamp"
mkdir -p "$res"
cd "$root"
[ -n "${GRPO_BIN:-}" ] || cargo build --release -p grpo-cli
bin=${GRPO_BIN:-$root/target/release/grpo}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The agent flags both grpo runs share (bench/agent_step.sh's).
agent=(--config examples/configs/agent_calculator.toml --tools="$tool" --max_tool_calling_iterations=3
       --eval_steps=0 --report_to=none --threads="$threads")

if [ -n "${START:-}" ]; then
  start=$START
else
  echo "== warm-up checkpoint (grpo: 3 supervised steps, then one GRPO step at lr 1e-30)"
  "$bin" train "${agent[@]}" --model="$model" --output_dir="$work/warm" --sft_warmup_steps=3 \
    --num_generations=8 --per_device_train_batch_size=64 \
    --max_steps=1 --learning_rate=1e-30 --max_completion_length=8 --log_completions=false \
    --save_strategy=steps --save_steps=1 --save_only_model=true > "$base.warmup.log" 2>&1
  start="$work/warm/checkpoint-1"
  grep -h '"warmup/cross_entropy"' "$work/warm/metrics.jsonl" | head -3 || true
fi
[ -f "$start/config.json" ] || { echo "no HF checkpoint at $start (see $base.warmup.log)"; exit 1; }

echo "== grpo: $steps agent steps ($prompts prompts x $gens episodes) from $start"
/usr/bin/time -v "$bin" train "${agent[@]}" --model="$start" --output_dir="$work/grpo" \
  --num_generations="$gens" --per_device_train_batch_size=$((prompts * gens)) \
  --sft_warmup_steps=0 --max_steps="$steps" --save_strategy=no \
  --log_completions=true --log_completions_steps=1 ${GRPO_ARGS:-} \
  > "$base.grpo.log" 2> "$base.grpo.time" || { tail -20 "$base.grpo.time"; exit 1; }
cp "$work/grpo/metrics.jsonl" "$base.grpo.metrics.jsonl"
cp "$work/grpo/completions.jsonl" "$base.grpo.completions.jsonl"
grep -q "dtype = auto: bf16\|dtype = bf16" "$base.grpo.log" "$base.grpo.time" && bf16=(--bf16) || bf16=()

# grpo's prompts, step by step (each group's 8 episodes share one), with their answers.
python3 - "$base.grpo.completions.jsonl" "$work/prompts.jsonl" <<'PY'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
out, last = [], None
for r in rows:
    key = (r["step"], r["prompt"])
    if key != last:  # a new group
        a, b = map(int, re.findall(r"\d{3}", r["prompt"])[:2])
        out.append({"prompt": r["prompt"], "answer": str(a * b), "grpo_step": r["step"]})
    last = key
with open(sys.argv[2], "w") as f:
    for o in out:
        f.write(json.dumps(o) + "\n")
print(f"{len(out)} prompts from grpo's {len(rows)} episodes")
PY
cp "$work/prompts.jsonl" "$base.prompts.jsonl"

echo "== TRL: $peer_steps agent steps from $start ${bf16[*]:-(f32)}"
/usr/bin/time -v "$py" bench/trl_agent_step.py --model="$start" --prompts-file="$work/prompts.jsonl" \
  --steps="$peer_steps" --prompts="$prompts" --generations="$gens" --threads="$threads" --tool="$tool" \
  ${bf16[@]+"${bf16[@]}"} ${TRL_ARGS:-} \
  > "$base.trl.jsonl" 2> "$base.trl.time" || { tail -30 "$base.trl.time"; exit 1; }

python3 - "$base" <<'PY'
import json, re, statistics, sys
base = sys.argv[1]
med = lambda xs: round(statistics.median(xs), 3) if xs else None
mean = lambda xs: round(statistics.mean(xs), 3) if xs else None
def peak_gb(path):
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(path).read())
    return round(int(m.group(1)) / 1e6, 2) if m else None
g = [json.loads(l) for l in open(f"{base}.grpo.metrics.jsonl")]
g = [r for r in g if "time/step" in r and r.get("step", 0) > 0]
t = [json.loads(l) for l in open(f"{base}.trl.jsonl") if l.startswith("{")]
t = [r for r in t if "step_s" in r]
gs, ts = g[1:] or g, t[1:] or t  # the first step warms up
out = {
    "grpo": {
        "steps": len(g), "step_s": med([r["time/step"] for r in gs]),
        "generate_s": med([r["time/generate"] for r in gs]),
        "tool_calls_per_episode": mean([r.get("agent/tool_calls_per_episode", 0) for r in g]),
        "turns_per_episode": mean([r.get("agent/turns_per_episode", 0) for r in g]),
        "episodes_calling_tools": mean([r.get("agent/episodes_calling_tools", 0) for r in g]),
        "correct": mean([r.get("rewards/correct/mean", 0) for r in g]),
        "peak_rss_gb": peak_gb(f"{base}.grpo.time"),
    },
    "trl": {
        "steps": len(t), "step_s": med([r["step_s"] for r in ts]), "generate_s": med([r["gen_s"] for r in ts]),
        "tool_calls_per_episode": mean([r.get("tool_calls_per_episode", 0) for r in t]),
        "turns_per_episode": mean([r["turns_per_episode"] for r in t]),
        "episodes_calling_tools": mean([r["episodes_calling_tools"] for r in t]),
        "correct": mean([r.get("correct", 0) for r in t]),
        "foreign_cpu_max": max((r["foreign_cpu"] or 0 for r in t), default=None),
        "peak_rss_gb": peak_gb(f"{base}.trl.time"),
    },
    "note": "medians from the second step on; tool calls, turns and correct: means over all steps",
}
if out["grpo"]["step_s"] and out["trl"]["step_s"]:
    out["trl_over_grpo_step"] = round(out["trl"]["step_s"] / out["grpo"]["step_s"], 2)
if out["grpo"]["generate_s"] and out["trl"]["generate_s"]:
    out["trl_over_grpo_generate"] = round(out["trl"]["generate_s"] / out["grpo"]["generate_s"], 2)
json.dump(out, open(f"{base}.summary.json", "w"), indent=1)
print(json.dumps(out, indent=1))
PY
