#!/usr/bin/env bash
# One fill-in GRPO step, grpo vs the seed's algorithm in PyTorch (../shared/bench/peers/
# fillin_grpo_bench.py), side by side in one run: the same HF masked-LM generator (BERT, char
# tokenizer, hidden 256, 4 layers), the same judge (BERT classifier, hidden 128, 2 layers), the
# same texts (generated here, seeded), 8 inputs x 8 fills, mask ratio 0.15, beta 0.1, lr 1e-5,
# temperature 0.8, top-p 0.95, f32, 2 threads.
#   bench/fillin_step.sh [STEPS]     # default 6 steps each; results in bench/results/fillin-step-<date>.*
# Needs ../shared/bench/peers/setup.sh once (the venv). Run on a quiet machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS_SRC:-$root/../shared/bench/peers}
PEERS_DIR=${PEERS_DIR:-/opt/peers}
steps=${1:-6}
B=8 G=8 threads=2
stamp=$(date +%Y%m%d-%H%M%S)
res="$root/bench/results"
mkdir -p "$res"
cd "$root"
if [ -z "${GRPO_BIN:-}" ]; then cargo build --release -p grpo-cli; fi
grpo=${GRPO_BIN:-$root/target/release/grpo}
work=${FILLIN_WORK:-$(mktemp -d)}

# Texts: sentences of made-up words, 60-100 characters, seeded (no copied text).
python3 - "$work/texts.txt" <<'PY'
import random, sys
rng = random.Random(7)
cons, vows = "bcdfghjklmnprstvwz", "aeiou"
words = ["".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 3))) for _ in range(300)]
lines = []
while len(lines) < 2000:
    s = " ".join(rng.choice(words) for _ in range(rng.randint(10, 24)))
    if 60 <= len(s) <= 100:
        lines.append(s)
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PY

# The generator and judge: pretrained briefly (the step's cost does not depend on their quality).
if [ ! -f "$work/gen/model.safetensors" ]; then
  "$grpo" --log-level warn pretrain --objective mlm --data "$work/texts.txt" --out "$work/gen" \
      --hidden 256 --layers 4 --heads 4 --max-len 128 --steps 60 --batch-size 16 --eval-every 0
fi
if [ ! -f "$work/judge/model.safetensors" ]; then
  "$grpo" --log-level warn pretrain --objective judge --data "$work/texts.txt" --generator "$work/gen" \
      --out "$work/judge" --hidden 128 --layers 2 --heads 4 --max-len 128 --steps 60 --batch-size 16 \
      --eval-every 0
fi
"$grpo" --log-level warn bench gemm --threads "$threads" --reps 3 | tee "$res/fillin-step-$stamp.gemm"

out=$(mktemp -d)
/usr/bin/time -v "$grpo" --log-level warn train --policy=fill_in --model="$work/gen" --judge="$work/judge" \
    --train_file="$work/texts.txt" --mask_ratio=0.15 --num_generations=$G \
    --per_device_train_batch_size=$((B * G)) --max_steps="$steps" --beta=0.1 --learning_rate=1e-5 \
    --loss_type=grpo --temperature=0.8 --top_p=0.95 --threads=$threads --output_dir="$out" \
    --save_steps=0 --eval_steps=0 --max_prompt_length=128 --shuffle_dataset=false \
    2> "$res/fillin-step-$stamp.grpo.time" > /dev/null
cp "$out/metrics.jsonl" "$res/fillin-step-$stamp.grpo.metrics.jsonl"
"$PEERS_DIR/venv/bin/python" "$peers/fillin_grpo_bench.py" --generator "$work/gen" --judge "$work/judge" \
    --texts "$work/texts.txt" --batch $B --group $G --mask-ratio 0.15 --steps "$steps" \
    --threads $threads > "$res/fillin-step-$stamp.peer.jsonl"

python3 - "$res/fillin-step-$stamp" "$work/gen/config.json" "$work/judge/config.json" <<'PY'
import json, statistics, sys
base = sys.argv[1]
med = statistics.median
g = [json.loads(l) for l in open(base + ".grpo.metrics.jsonl") if '"loss"' in l][1:]
p = [json.loads(l) for l in open(base + ".peer.jsonl") if '"step"' in l][1:]
gemm = [json.loads(l) for l in open(base + ".gemm") if l.startswith("{")]
gemm_rate = gemm[0]["gflops"] if gemm else 0  # 1024^3
def params(cfg):  # non-embedding matmul parameters of a BERT encoder
    c = json.load(open(cfg)); h, l, i = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    return l * (4 * h * h + 2 * h * i), h
pg, hg = params(sys.argv[2]); pj, _ = params(sys.argv[3])
# Tokens a step feeds each model: per input ~ its length; grpo runs the generator once per input
# (sample, reference, update forward + backward), the judge once per fill.
B, G = 8, 8
tok_in = med(r["tokens"] for r in p) / (B * G)  # tokens per input (the peer repeats each input G times)
flops_g = 2 * pg * tok_in * B * (1 + 1 + 3) + 2 * pj * tok_in * B * G
flops_p = 2 * pg * tok_in * B * G * (1 + 1 + 3) + 2 * pj * tok_in * B * G
step_g = med(r["time/step"] for r in g)
step_p = med(r["step_s"] for r in p)
row = {
    "bench": "fillin_step", "steps_measured": len(g), "batch": B, "group": G,
    "grpo": {"step_s": step_g, "sample_s": med(r["time/generate"] for r in g),
             "judge_s": med(r["time/score"] for r in g), "reference_s": med(r["time/reference"] for r in g),
             "update_s": med(r["time/update"] for r in g), "model_gflop": flops_g / 1e9,
             "gflops": flops_g / 1e9 / step_g},
    "peer": {"step_s": step_p, "sample_s": med(r["sample_s"] for r in p), "judge_s": med(r["judge_s"] for r in p),
             "reference_s": med(r["ref_s"] for r in p), "update_s": med(r["update_s"] for r in p),
             "model_gflop": flops_p / 1e9, "gflops": flops_p / 1e9 / step_p},
    "grpo_over_peer": step_g / step_p, "gemm_gflops": gemm_rate,
}
print(json.dumps(row, indent=1))
json.dump(row, open(base + ".summary.json", "w"), indent=1)
PY
grep -h "Maximum resident" "$res/fillin-step-$stamp.grpo.time"
