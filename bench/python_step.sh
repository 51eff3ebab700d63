#!/usr/bin/env bash
# The GRPO step from Python (GRPOTrainer, the package in a release build) against `grpo train` on
# the same run, in one run: bench/configs/trl_peer.toml (SmolLM2-135M-Instruct f32, 8 prompts x 4
# generations x 64 tokens, beta 0.04, 2 threads), as bench/grpo_step.sh measures it against TRL.
#   bench/python_step.sh [STEPS [PEER_STEPS]]  # default 8 and 3; results in bench/results/python-step-<date>.jsonl
# Cases: grpo train; GRPOTrainer with the config's rewards (what the Python layer adds); GRPOTrainer
# with Python twins of them as reward functions (in-process Python rewards); TRL's GRPOTrainer on the
# peer step (PEER_STEPS steps; 0: none), as bench/grpo_step.sh runs it. GRPO_PY_VENV=dir reuses
# a venv holding the package (else target/bench-venv, made once with pip install ./crates/grpo-py).
# Needs ../shared/bench/peers/setup.sh once. Run on a quiet machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS_SRC:-$root/../shared/bench/peers}
PEERS_DIR=${PEERS_DIR:-/opt/peers}
steps=${1:-8}
peer_steps=${2:-3}
out="$root/bench/results/python-step-$(date +%Y%m%d-%H%M%S).jsonl"
mkdir -p "$root/bench/results"
cd "$root"
cargo build --release -p grpo-cli
py_venv=${GRPO_PY_VENV:-$root/target/bench-venv}
if ! "$py_venv/bin/python" -c "import grpo" 2>/dev/null; then
  python3 -m venv "$py_venv" && "$py_venv/bin/pip" install -q "$root/crates/grpo-py"
fi
model="$PEERS_DIR/smollm2-135m-instruct-f32"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$peers/addition_task.py" $((steps * 8)) 0 > "$work/rows.jsonl"
summary() { # name, metrics.jsonl
  python3 - "$2" "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
med = lambda k: statistics.median(r[k] for r in rows)
print(json.dumps({"bench": "python_step", "run": sys.argv[2], "steps": len(rows),
                  "s_per_step_median": med("time/step"), "generate": med("time/generate"),
                  "score": med("time/score"), "update": med("time/update"),
                  "reward_mean": statistics.mean(r["reward"] for r in rows),
                  "elapsed_s": sum(r["time/step"] for r in rows)}))
PY
}
{
  target/release/grpo train --config bench/configs/trl_peer.toml --model="$model" \
    --train_file="$work/rows.jsonl" --output_dir="$work/cli" --max_steps="$steps" >/dev/null 2>&1
  summary grpo_train "$work/cli/metrics.jsonl"
  for rewards in config python; do
    "$py_venv/bin/python" bench/python_step.py --config bench/configs/trl_peer.toml \
      --model "$model" --data "$work/rows.jsonl" --out "$work/py-$rewards" --steps "$steps" \
      --rewards "$rewards" >/dev/null 2>&1
    summary "grpo_python_rewards_$rewards" "$work/py-$rewards/metrics.jsonl"
  done
  # The config's rewards from Python are the CLI's run exactly: the same metrics, bit for bit.
  python3 - "$work/cli/metrics.jsonl" "$work/py-config/metrics.jsonl" <<'PY'
import json, sys
keep = lambda r: {k: v for k, v in r.items() if not k.startswith(("time", "memory/")) and k != "tokens_per_second"}
a, b = ([keep(json.loads(l)) for l in open(p)] for p in sys.argv[1:])
print(json.dumps({"bench": "python_step", "check": "python_equals_cli", "equal": a == b}))
PY
  if [ "$peer_steps" -gt 0 ] && [ -x "$PEERS_DIR/venv/bin/python" ]; then
    "$PEERS_DIR/venv/bin/python" "$peers/trl_grpo_bench.py" --steps "$peer_steps" --prompts 8 \
      --generations 4 --max-tokens 64 --seed 0 --lr 2e-5 --beta 0.04 2>/dev/null | tail -1
  fi
} | tee "$out"
echo "results: $out" >&2
