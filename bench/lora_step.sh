#!/usr/bin/env bash
# Full fine-tuning vs LoRA vs QLoRA GRPO steps, grpo beside TRL + peft LoRA, in one run: the TRL
# peer's step (SmolLM2-135M-Instruct f32, 8 prompts x 4 generations x <= 64 tokens, beta 0.04,
# dapo, lr 2e-5, 2 threads), LoRA r 16, alpha 32, dropout 0.05 on q_proj, v_proj.
#   bench/lora_step.sh [STEPS [PEER_STEPS]]    # default 5 each; results in bench/results/lora-step-<date>.*
# Needs ../shared/bench/peers/setup.sh once. Run on a quiet machine (no build, no other job).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS_SRC:-$root/../shared/bench/peers}
PEERS_DIR=${PEERS_DIR:-/opt/peers}
steps=${1:-5}
peer_steps=${2:-$steps}
stamp=$(date +%Y%m%d-%H%M%S)
res="$root/bench/results"
mkdir -p "$res"
cd "$root"
cargo build --release -p grpo-cli
data=$(mktemp --suffix=.jsonl)
python3 "$peers/addition_task.py" $((steps * 8)) 0 > "$data"
lora="--lora.r=16 --lora.alpha=32 --lora.dropout=0.05 --lora.target_modules=q_proj,v_proj"
run() { # name, extra args
  local name=$1; shift
  local out; out=$(mktemp -d)
  /usr/bin/time -v "$root/target/release/grpo" train --config bench/configs/trl_peer.toml \
      --model="$PEERS_DIR/smollm2-135m-instruct-f32" --train_file="$data" --output_dir="$out" \
      --max_steps="$steps" "$@" 2> "$res/lora-step-$stamp.$name.time" > /dev/null
  cp "$out/metrics.jsonl" "$res/lora-step-$stamp.$name.metrics.jsonl"
  python3 - "$name" "$res/lora-step-$stamp.$name.metrics.jsonl" "$res/lora-step-$stamp.$name.time" <<'PY'
import json, re, statistics, sys
name, metrics, timef = sys.argv[1:4]
rows = [json.loads(l) for l in open(metrics) if '"loss"' in l]
med = lambda k, rs=rows: round(statistics.median(r[k] for r in rs), 2)
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(timef).read()).group(1))
later = rows[1:] or rows
print(json.dumps({"run": "grpo-" + name, "steps": len(rows), "s_per_step_median": med("time/step"),
                  "s_per_step_median_excl_first": med("time/step", later),
                  "generate": med("time/generate"), "reference": med("time/reference"),
                  "update": med("time/update"), "mean_length": med("completions/mean_length"),
                  "peak_rss_gb": round(rss / 1024 / 1024, 2)}))
PY
}
run full
run lora $lora
run qlora $lora --base_quantization=q4_0
run lora-ckpt $lora --gradient_checkpointing=true
if [ -x "$PEERS_DIR/venv/bin/python" ]; then
  /usr/bin/time -v "$PEERS_DIR/venv/bin/python" "$root/bench/trl_lora_step.py" --steps "$peer_steps" \
      --prompts 8 --generations 4 --max-tokens 64 --seed 0 --lr 2e-5 --beta 0.04 \
      --lora-r 16 --lora-alpha 32 --lora-dropout 0.05 --targets q_proj,v_proj \
      2> "$res/lora-step-$stamp.trl-lora.time" > "$res/lora-step-$stamp.trl-lora.jsonl"
  python3 - "$res/lora-step-$stamp.trl-lora.jsonl" "$res/lora-step-$stamp.trl-lora.time" <<'PY'
import json, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"step"')]
med = lambda k, rs=rows: round(statistics.median(r[k] for r in rs), 2)
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(sys.argv[2]).read()).group(1))
later = rows[1:] or rows
print(json.dumps({"run": "trl-peft-lora", "steps": len(rows), "s_per_step_median": med("step_s"),
                  "s_per_step_median_excl_first": med("step_s", later), "generate": med("gen_s"),
                  "reference": med("ref_s"), "update": med("train_s"),
                  "mean_length": med("completions_length"), "foreign_cpu_max": max(r["foreign_cpu"] for r in rows),
                  "peak_rss_gb": round(rss / 1024 / 1024, 2)}))
PY
fi
