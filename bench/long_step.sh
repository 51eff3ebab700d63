#!/usr/bin/env bash
# Long, uneven completions: grpo against TRL 1.16 (HF generate, and transformers' continuous
# batching, `use_transformers_continuous_batching`) on one random-weight model that ends a
# completion with probability about 2.77/CAP per token (bench/make_model.py --eos-rate): median
# length about CAP/4, a tail that runs to the cap, lengths in a group 10x apart. Same prompts,
# batch, rewards (bench/varied_reward.py on both sides) and hyper-parameters as bench/grpo_step.sh.
#   bench/long_step.sh [STEPS [CAP [PROMPTS [GENERATIONS [SHAPE]]]]]   # default 3 1024 4 8 135m
#   DEVICE=cuda BF16=1 bench/long_step.sh 3 1024 16 8 1.7b             # on a GPU, bf16 both
#   RUNS="grpo trl"    (default "grpo trl trl-cb"; which runs)
#   ADAPTER=lora|qlora (default none: full fine-tuning): LoRA r 16 (alpha 32, no dropout) on every
#                      linear layer on both sides; qlora: its base in NF4 (grpo's
#                      base_quantization=nf4, TRL's bitsandbytes 4-bit), bf16 weights on TRL's side
#   GRPO_ARGS="..."    more grpo options (e.g. --gradient_checkpointing=true, TRL's default)
#   EOS_RATE=P         the model's end-of-sequence rate instead of 2.77/CAP (0: none, every
#                      completion runs to the cap: equal work without a length spread)
#   TRL_GRAD_ACCUM=N   TRL's gradient accumulation (its micro-batch: the round / N completions).
#                      Unset: the fewest micro-batches of at most TRL_MICRO_TOKENS (131072)
#                      completion slots each. TRL pads every completion to the longest, and with
#                      gradient checkpointing it keeps each layer's input for the micro-batch:
#                      under bf16 autocast over the peer's f32 weights the residual stream is f32,
#                      ~200 KB a token at 1.7B, plus ~80 KB a token for the block it recomputes
#                      (its fused LM head keeps no [rows, cap, vocab] logits). 16 x 8 rows at cap
#                      4096 in one micro-batch would be ~150 GB, past an H200; they get 4. Every
#                      other shape run so far fits in one (N = 1, as before). grpo sizes its own
#                      passes (forward_chunk_tokens); one optimizer step per round on both sides.
# On a GPU machine without a toolchain (the GPU kit, ../shared/gpu/): GRPO_BIN=.gpu/bin/grpo,
# PEER_PYTHON=python3 (with TRL's wheels on PYTHONPATH), PEERS_SRC=.gpu/peers; peak GPU memory is
# polled from nvidia-smi. MODEL_DIR=dir: the model there (made there first if absent).
# The learning rate is 1e-6 (LR=...): at the peer's 2e-5 one step moved this model's EOS rate far
# (mean length 504 -> 963 of 1024 at step 2, on the CPU at cap 1024), and the point here is equal,
# uneven work on both sides. Medians from step 2. Results: bench/results/long-step-<date>.* (one JSON summary per run in
# .summary.jsonl). Needs ../shared/bench/peers/setup.sh once. Run on a quiet machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS_SRC:-$root/../shared/bench/peers}
PEERS_DIR=${PEERS_DIR:-/opt/peers}
py=${PEER_PYTHON:-$PEERS_DIR/venv/bin/python}
steps=${1:-3}; cap=${2:-1024}; prompts=${3:-4}; gens=${4:-8}; shape=${5:-135m}; lr=${LR:-1e-6}
runs=${RUNS:-grpo trl trl-cb}
device=${DEVICE:-cpu}
stamp=$(date +%Y%m%d-%H%M%S); [ "$device" != cpu ] && stamp="$device-$stamp"
res="$root/bench/results"; mkdir -p "$res"; out="$res/long-step-$stamp"
cd "$root"
rate=${EOS_RATE:-$(python3 -c "print(round(2.77 / $cap, 6))")}
model=${MODEL_DIR:-/tmp/grpo-long-$shape-$rate}
if [ ! -f "$model/config.json" ]; then
  eos=(--eos-rate "$rate"); [ "$rate" = 0 ] && eos=()
  "$py" bench/make_model.py tests/fixtures/smollm2 "$model" "$shape" "${eos[@]}" \
    --device "$device" | tail -1 | tee "$out.model.json"
fi
grpo_args=(--device="$device"); peer_args=(--varied)
case ${ADAPTER:-none} in
  none) ;;
  lora|qlora)
    grpo_args+=(--lora.r=16 --lora.alpha=32 --lora.dropout=0 --lora.target_modules=all-linear)
    peer_args+=(--lora 16 --bf16-weights)
    [ "$ADAPTER" = qlora ] && { grpo_args+=(--base_quantization=nf4); peer_args+=(--qlora); } ;;
  *) echo "ADAPTER=$ADAPTER: none, lora or qlora" >&2; exit 2 ;;
esac
# shellcheck disable=SC2206  # options, split on spaces
[ -n "${GRPO_ARGS:-}" ] && grpo_args+=($GRPO_ARGS)
if [ "${BF16:-0}" = 1 ]; then grpo_args+=(--dtype=bf16); peer_args+=(--bf16); fi
if [ -z "${GRPO_BIN:-}" ]; then
  if [ "$device" != cpu ]; then cargo build --release -p grpo-cli --features cuda
  else cargo build --release -p grpo-cli; fi
fi
grpo_bin=${GRPO_BIN:-$root/target/release/grpo}
# Peak memory: the process's RSS (GNU time), and on a GPU the card's, polled by nvidia-smi.
timed() { if [ -x /usr/bin/time ]; then /usr/bin/time -v "$@"; else "$@"; fi; }
poll() {
  [ "$device" = cpu ] && return
  while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> "$1"; sleep 0.5; done &
  POLL=$!
}
unpoll() { if [ -n "${POLL:-}" ]; then kill "$POLL" 2>/dev/null; wait "$POLL" 2>/dev/null || true; POLL=; fi; }
# TRL's micro-batch: the smallest divisor N of the round with round / N x cap <= the budget.
round=$((prompts * gens))
accum=${TRL_GRAD_ACCUM:-$(python3 -c "import sys; n, c, b = map(int, sys.argv[1:]); print(next(d for d in range(1, n + 1) if n % d == 0 and (n // d) * c <= b or d == n))" "$round" "$cap" "${TRL_MICRO_TOKENS:-131072}")}
export ACCUM=$accum  # for summary()
data=$(mktemp --suffix=.jsonl)
python3 "$peers/addition_task.py" $((steps * prompts)) 0 > "$data"
summary() {  # name kind(grpo|trl) file
  python3 - "$@" >> "$out.summary.jsonl" <<'PY'
import json, re, statistics, sys
name, kind, path = sys.argv[1:4]
rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(path + ".time").read())
try:
    gpu = max(int(l) for l in open(path + ".gpumem") if l.strip().isdigit())
except (OSError, ValueError):
    gpu = None
if kind == "grpo":
    rows = [json.loads(l) for l in open(path + ".metrics.jsonl") if '"loss"' in l]
    keys = {"step": "time/step", "generate": "time/generate", "reference": "time/reference",
            "update": "time/update", "mean_length": "completions/mean_length"}
else:
    rows = [json.loads(l) for l in open(path + ".jsonl") if l.startswith('{"step"')]
    keys = {"step": "step_s", "generate": "gen_s", "reference": "ref_s", "update": "train_s",
            "mean_length": "completions_length"}
r = rows[1:] or rows
med = {k: round(statistics.median(x.get(v, 0) for x in r), 3) for k, v in keys.items()}
import os
extra = {"trl_grad_accum": int(os.environ["ACCUM"])} if kind == "trl" else {}
print(json.dumps({"bench": "long_step", "run": name, "adapter": os.environ.get("ADAPTER", "none"),
                  "steps": len(rows), **med, **extra,
                  "peak_rss_mb": round(int(rss[1]) / 1024) if rss else None, "peak_gpu_mib": gpu}))
PY
  tail -1 "$out.summary.jsonl"
}
for run in $runs; do
  case $run in
    grpo)
      dir=$(mktemp -d); poll "$out.grpo.gpumem"
      timed "$grpo_bin" train --config bench/configs/long_step.toml --model="$model" \
        --train_file="$data" --output_dir="$dir" --max_steps="$steps" --num_generations="$gens" \
        --per_device_train_batch_size=$((prompts * gens)) --max_completion_length="$cap" \
        --learning_rate="$lr" "${grpo_args[@]}" > "$out.grpo.log" 2> "$out.grpo.time" || { unpoll; tail -5 "$out.grpo.time"; exit 1; }
      unpoll
      cp "$dir/metrics.jsonl" "$out.grpo.metrics.jsonl"; rm -rf "$dir"
      summary grpo grpo "$out.grpo" ;;
    trl|trl-cb)
      extra=(); [ $run = trl-cb ] && extra=(--cb)
      poll "$out.$run.gpumem"
      timed "$py" bench/trl_step_device.py "${peer_args[@]}" "${extra[@]}" --model "$model" \
        --steps "$steps" --prompts "$prompts" --generations "$gens" --max-tokens "$cap" --seed 0 \
        --lr "$lr" --beta 0.04 --grad-accum "$accum" --output-dir "$(mktemp -d)" > "$out.$run.jsonl" 2> "$out.$run.time" \
        || { unpoll; tail -5 "$out.$run.time"; echo "$run failed" >> "$out.summary.jsonl"; continue; }
      unpoll
      summary "$run" trl "$out.$run" ;;
  esac
done
rm -f "$data"
