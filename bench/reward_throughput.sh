#!/usr/bin/env bash
# Reward throughput: the same 1,024 completions scored (a) through grpo's `kind = "command"` with a
# Python scorer (processes = 1 and 2, one request per line; batch_size = 64; 8 processes for the slow
# one), and (b) TRL's way,
# one in-process call of the same reward function f(prompts, completions, **kwargs), and (c) grpo's
# Python package's way: the function in process, called by the library (GRPOTrainer's reward_funcs).
# Two functions:
# a cheap rule (last number == answer) and a slow one (2 ms per completion), plus grpo's built-in
# answer_match rule for scale. One JSON line per case.
#   bench/reward_throughput.sh            # writes bench/results/reward-throughput-<date>.jsonl
#   N=16 REPS=1 bench/reward_throughput.sh  # a quick check that it works
# Run it on a quiet machine; the scorers use one core per process.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS_SRC:-$root/../shared/bench/peers}
python=${PYTHON:-python3}
n=${N:-1024}
reps=${REPS:-3}
out="$root/bench/results/reward-throughput-$(date +%Y%m%d-%H%M%S).jsonl"
mkdir -p "$root/bench/results"
cd "$root"
profile=${PROFILE:-release}   # PROFILE=dev reuses a debug build for a quick check
# The Python package (release build) in a venv of its own, made once: GRPO_PY_VENV=dir reuses one.
py_venv=${GRPO_PY_VENV:-$root/target/bench-venv}
if ! "$py_venv/bin/python" -c "import grpo" 2>/dev/null; then
  python3 -m venv "$py_venv" && "$py_venv/bin/pip" install -q "$root/crates/grpo-py"
fi
py_pkg="$py_venv/bin/python"
cargo build --profile "$profile" -p grpo --example reward_bench
bench="${CARGO_TARGET_DIR:-$root/target}/$([ "$profile" = dev ] && echo debug || echo "$profile")/examples/reward_bench"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1,024 completions: the peer task's addition problems (256 prompts, seed 0), four answers each,
# right and wrong, in the shapes a model writes them.
"$python" - "$peers/addition_task.py" "$n" > "$work/completions.jsonl" <<'PY'
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("addition_task", sys.argv[1])
task = importlib.util.module_from_spec(spec); spec.loader.exec_module(task)
for p in task.make_problems((int(sys.argv[2]) + 3) // 4, seed=0):
    s = int(p["answer"])
    for text in (f"The answer is {s}.", f"{s - 1}", f"Let me add them: the total is {s}, so {s}.",
                 f"I think it is {s + 10}."):
        print(json.dumps({"prompt": p["question"], "completion": text, "answer": p["answer"]}))
PY
head -n "$n" "$work/completions.jsonl" > "$work/c.jsonl"

{
  # grpo's built-in rule (Rust, in process): the same last-number check.
  printf 'kind = "answer_match"\nextract = "last_number"\n' > "$work/builtin.toml"
  "$bench" "$work/c.jsonl" "$work/builtin.toml" "grpo_builtin:answer_match" "$reps"
  for fn in last_number_reward slow_reward; do
    cases="1 1|2 1|1 64"
    # The slow reward waits (I/O), so more scorer processes than cores still help.
    [ "$fn" = slow_reward ] && cases="$cases|8 1"
    IFS='|' read -ra case_list <<< "$cases"
    for case in "${case_list[@]}"; do
      set -- $case
      cat > "$work/reward.toml" <<TOML
kind = "command"
command = ["$python", "$root/examples/scorers/trl_adapter.py", "$root/bench/reward_fns.py:$fn"]
processes = $1
batch_size = $2
TOML
      "$bench" "$work/c.jsonl" "$work/reward.toml" "grpo_command:$fn:processes=$1:batch_size=$2" "$reps"
    done
    "$python" bench/reward_inprocess.py "$work/c.jsonl" "bench/reward_fns.py:$fn" "$reps"
    # GRPOTrainer's way: the function in process, called by the library (the package's Python).
    "$py_pkg" bench/reward_inprocess_grpo.py "$work/c.jsonl" "bench/reward_fns.py:$fn" "$reps"
  done
} | tee "$out"
echo "results: $out" >&2
