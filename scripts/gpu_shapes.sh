#!/bin/bash
# Issue 59's shapes on a GPU, grpo against TRL 1.16 in one call: bench/long_step.sh per case
# (one random-weight model per shape, made on the device; same prompts, batch and rewards on both
# sides; peak GPU memory polled), from the GPU kit's binaries and wheels. After
# ../shared/gpu/build_cuda.sh, ../shared/gpu/pack.sh and scripts/pack_bnb.sh here; on the GPU
# machine, from the project root with .gpu/ carried along:
#   OUT=$OUT bash scripts/gpu_shapes.sh                 (CASES=long: 1.7B 16x8, uneven, caps 1024
#                                                       and 4096, TRL with HF generate and with
#                                                       continuous batching)
#   CASES=big OUT=$OUT bash scripts/gpu_shapes.sh       (8B LoRA r 16 and QLoRA NF4 8x8x512, 4B
#                                                       full 16x8x512, all bf16, every completion
#                                                       to the cap; TRL with HF generate)
#   CASES=long1k / CASES=long4k                         (one of the two long caps)
#   CASES="SHAPE:ADAPTER:CAP:PROMPTS:GENS:EOS_RATE[:GRPO_ARGS] ..." (EOS_RATE "-": 2.77/CAP, the
#                                                       spread; GRPO_ARGS: grpo options, comma-separated)
# Device time, estimated from the kit's H200 rates (TRL's HF generate ~33 ms a decoding step at
# 1.7B x 128 rows, grpo's ~5 ms), not measured: long1k ~7 minutes; long4k ~15-20 (TRL decodes
# 4,096 steps a step, each run; STEPS=2 and one RUNS per call to fit a call's 10 minutes); big
# ~9. So CASES=long does not fit one call: the 4,096 case starts with the 120 s left after
# long1k and is cut off. TRL's micro-batches: bench/long_step.sh (TRL_GRAD_ACCUM). At cap 4,096
# TRL's HF generate may run out of memory: its cache holds rows x (prompt + cap) slots in every
# layer (1.7B has 32 KV heads: 98 GB for 128 x 4,160 in bf16, more where autocast over the
# peer's f32 weights leaves keys in f32 after RoPE); that is then the result.
# STEPS=3, RUNS="grpo trl trl-cb" (long) / "grpo trl" (big), BUDGET=540 seconds: a case starts
# only with 120 s left. TRL's QLoRA needs bitsandbytes: the card's own, else .gpu/bnb.zip
# (scripts/pack_bnb.sh). Results: $OUT/shapes-summary.txt and $OUT/long-step-cuda-*. A dry run on
# the CPU (tiny shapes): DEVICE=cpu PEER_PYTHON=/opt/peers/venv/bin/python CASES="tiny:qlora:16:2:4:0".
set -u
T0=$SECONDS; ROOT=$PWD; G=$ROOT/.gpu; FIN=${OUT:-$ROOT/gpu-out}; mkdir -p "$FIN"
SUM=$FIN/shapes-summary.txt
SITE=$(python3 -c 'import sys; print([p for p in sys.path if p.endswith("site-packages")][0])')
NV=$(find "$SITE/nvidia" -name "lib*.so*" -printf "%h\n" 2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=$NV/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
PY=${PEER_PYTHON:-python3}  # the card's Python (torch, transformers, peft); another for a dry run
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$G"/whl/*.whl > "$FIN/pip.txt" 2>&1
if ! $PY -c "import bitsandbytes" 2>/dev/null && [ -f "$G/bnb.zip" ]; then
  python3 -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/site')" "$G/bnb.zip"
fi
python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open('/tmp/grpo-shapes','wb'))" "$G/bin/grpo.xz"
chmod +x /tmp/grpo-shapes
export PYTHONPATH=/tmp/site PEERS_SRC=$G/peers GRPO_BIN=/tmp/grpo-shapes PEER_PYTHON=$PY
export DEVICE=${DEVICE:-cuda} BF16=1
$PY -c 'import torch, transformers, trl, peft; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "trl", trl.__version__, "peft", peft.__version__)' >> "$SUM" 2>&1
$PY -c 'import bitsandbytes; print("bitsandbytes", bitsandbytes.__version__)' >> "$SUM" 2>&1
cases=${CASES:-long}; runs=${RUNS:-grpo trl trl-cb}
case $cases in
  long) cases="1.7b:none:1024:16:8:- 1.7b:none:4096:16:8:-" ;;
  long1k) cases="1.7b:none:1024:16:8:-" ;;
  long4k) cases="1.7b:none:4096:16:8:-" ;;
  # 8B with gradient checkpointing (TRL's default): LoRA's adapters keep ~29 MB a token without
  # it (grpo plan). With it the unset pass (half the free memory) would be the whole round, 36.8k
  # tokens and ~56 GiB of activations, where TRL holds the micro-batch's layer inputs (~10 GB);
  # passes of a group (4,600 tokens, --forward_chunk_tokens=8192) keep the update under the
  # rollout: grpo plan 13.1 GiB for QLoRA, 32.8 GiB for LoRA (13 GiB of it the merged sampling
  # copies), for ~0.1 s a step of QLoRA's dequantization per pass.
  big) cases="8b:qlora:512:8:8:0:--gradient_checkpointing=true,--forward_chunk_tokens=8192 8b:lora:512:8:8:0:--gradient_checkpointing=true,--forward_chunk_tokens=8192 4b:none:512:16:8:0"
       runs=${RUNS:-grpo trl} ;;
esac
for c in $cases; do
  IFS=: read -r shape adapter cap prompts gens eos extra <<< "$c"
  left=$(( ${BUDGET:-540} - (SECONDS - T0) ))
  [ $left -lt 120 ] && { echo "case $c skipped ($left s left)" >> "$SUM"; continue; }
  echo "== [$((SECONDS - T0))s] case $c" >> "$SUM"
  rate=(); [ "$eos" != - ] && rate=(EOS_RATE="$eos")
  # One model per shape and rate, kept for the next case of the same shape (the spread's rate
  # follows the cap).
  model=/tmp/m-$shape-eos$eos; [ "$eos" = - ] && model=/tmp/m-$shape-cap$cap
  env "${rate[@]}" ADAPTER="$adapter" RUNS="$runs" MODEL_DIR="$model" GRPO_ARGS="${extra//,/ }" timeout $left \
    bash bench/long_step.sh "${STEPS:-3}" "$cap" "$prompts" "$gens" "$shape" >> "$SUM" 2>&1
  df -h /tmp | tail -1 >> "$SUM"
done
cp bench/results/long-step-$DEVICE-* "$FIN/" 2>/dev/null
echo "== [$((SECONDS - T0))s] done" >> "$SUM"
