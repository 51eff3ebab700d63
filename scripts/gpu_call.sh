#!/bin/bash
# One GPU call for issue 31's work, after ../shared/gpu/build_cuda.sh and ../shared/gpu/pack.sh
# here: `grpo bench ops` on the 1.7B shape with grpo's GPU kernels at their default (KINDS adds
# `cores`: attention on CUDA cores, and `forward`, `off`), the one-op layer's GPU test, then the kit (`.gpu/run.sh`: GPU tests, grpo vs TRL at the kit's shapes, GRPO_PROFILE=1) with
# the kernel set whose layer forward + backward was fastest. On the GPU machine, from the
# project root (with .gpu/ carried along):
#   OUT=$OUT bash scripts/gpu_call.sh        (~7 minutes; BUDGET=seconds for the whole call, 530;
#                                             EXTRA=1 adds the runs after the kit, BUDGET=580;
#                                             the one-op layer's GPU test before the kit)
#   KIT=0 OUT=$OUT bash scripts/gpu_call.sh  (~2 minutes: the pieces and the GPU tests, no kit)
#   OPS=0 KIT=0 OUT=$OUT bash scripts/gpu_call.sh  (the GPU tests alone)
#   KINDS=default TESTS=0 KIT=0 OUT=$OUT bash scripts/gpu_call.sh  (the pieces, default kernels)
# Results in $OUT: ops-summary.txt (per-piece ms per kernel set), summary.txt and logs.tgz (the kit).
set -u
T0=$SECONDS; ROOT=$PWD; G=$ROOT/.gpu; FIN=${OUT:-$ROOT/gpu-out}; mkdir -p $FIN
log() { echo "== [$((SECONDS-T0))s] $*" | tee -a $FIN/ops-summary.txt; }
SITE=$(python3 -c 'import sys; print([p for p in sys.path if p.endswith("site-packages")][0])')
NV=$(find $SITE/nvidia -name "lib*.so*" -printf "%h\n" 2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=$NV/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open('/tmp/grpo-ops','wb'))" $G/bin/grpo.xz
chmod +x /tmp/grpo-ops
# Kernel sets timed (KINDS="default cores forward off" to compare all: in every H200 call so far
# `default` was the fastest of default, forward and off; `cores` is default with attention on
# CUDA cores, 2.2x slower than attention_tc.cu's forward + backward on the H200, 2026-11-28).
KINDS=${KINDS:-default}; [ "${OPS:-1}" = 0 ] && KINDS=""  # OPS=0: no pieces
for k in $KINDS; do
  log "ops 1.7b, kernels: $k"
  kset=$k; att=tensor; [ "$k" = cores ] && { kset=default; att=cores; }
  GRPO_GPU_KERNELS=$kset GRPO_GPU_ATTENTION=$att timeout 60 /tmp/grpo-ops bench ops --device cuda --shape 1.7b --rows 46 --seq 304 \
    --reps 3 --keep-pool > $FIN/ops-17-$k.jsonl 2> $FIN/ops-17-$k.err
  tail -2 $FIN/ops-17-$k.err >> $FIN/ops-summary.txt
done
# The kernel set whose layer forward + backward was fastest, and the decoding attention: the
# fastest of the block kernel, the warp kernel (`decode_attention_block`, `_warp`) and candle's
# batched matmuls (`decode_attention` under off), as GRPO_GPU_DECODE=kernel, warp or ops.
read BEST DECODE < <(python3 - $FIN <<'PY' 2>>$FIN/ops-summary.txt
import json, os, sys
best, dec = None, {}
with open(os.path.join(sys.argv[1], "ops-summary.txt"), "a") as out:
    for k in ["default", "cores", "forward", "off"]:
        path = os.path.join(sys.argv[1], f"ops-17-{k}.jsonl")
        for line in open(path) if os.path.exists(path) else []:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            print(k, r["op"], "fwd_ms", r["fwd_ms"], "fwd_bwd_ms", r["fwd_bwd_ms"], "host_ms", r.get("host_ms", "-"), file=out)
            if r["op"] == "layer" and (best is None or r["fwd_bwd_ms"] < best[1]):
                best = (k, r["fwd_bwd_ms"])
            if r["op"] == "decode_attention" and k == "off":
                dec["ops"] = r["fwd_ms"]
            if r["op"] == "decode_attention_block":
                dec["kernel"] = min(dec.get("kernel", 1e9), r["fwd_ms"])
            if r["op"] == "decode_attention_warp":
                dec["warp"] = min(dec.get("warp", 1e9), r["fwd_ms"])
print(best[0] if best else "default", min(dec, key=dec.get) if dec else "kernel")
PY
)
export GRPO_GPU_DECODE=$DECODE
log "decoding attention: $DECODE"
if [ "${KIT:-1}" = 0 ]; then  # a short call: the pieces and the GPU tests only
  python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open('/tmp/grpo-tests','wb'))" $G/bin/cuda-tests.xz
  chmod +x /tmp/grpo-tests; src=$(cat $G/src_root)
  if [ "$src" != "$ROOT" ]; then
    mkdir -p "$(dirname "$src")"; [ -e "$src" ] && [ ! -L "$src" ] && mv "$src" "$src.orig"; ln -sfn "$ROOT" "$src"
  fi
  [ "${TESTS:-1}" = 0 ] && { log "done (no tests)"; exit 0; }
  log "GPU tests"; timeout 150 /tmp/grpo-tests --test-threads=1 --include-ignored > $FIN/cuda-tests.txt 2>&1
  grep -E "^test |test result" $FIN/cuda-tests.txt >> $FIN/ops-summary.txt; log "done"; exit 0
fi
export GRPO_GPU_ATTENTION=tensor
[ "$BEST" = cores ] && { BEST=default; export GRPO_GPU_ATTENTION=cores; }
# The one-op layer (gpu_layer.rs, on by default where its start-up check passes): its GPU test
# first, which prints each tensor's error against candle ops (the forward's intermediates, the
# output, every gradient; a small layer in f32 and bf16, the 135M and 1.7B layers in bf16); the
# kit runs it (GRPO_GPU_LAYER=op) only when that test passed and `bench ops` timed it faster than
# the graph, else with GRPO_GPU_LAYER=graph.
python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open('/tmp/grpo-tests','wb'))" $G/bin/cuda-tests.xz
chmod +x /tmp/grpo-tests; src=$(cat $G/src_root)
if [ "$src" != "$ROOT" ]; then
  mkdir -p "$(dirname "$src")"; [ -e "$src" ] && [ ! -L "$src" ] && mv "$src" "$src.orig"; ln -sfn "$ROOT" "$src"
fi
log "the one-op layer's GPU test"
timeout 60 /tmp/grpo-tests --test-threads=1 --nocapture gpu_layer_op > $FIN/layer-op-test.txt 2>&1; LRC=$?
grep -E "layer op against|test result" $FIN/layer-op-test.txt >> $FIN/ops-summary.txt
LAYER=graph
if [ $LRC = 0 ] && python3 - $FIN <<'PY'
import json, os, sys
t = {}
for line in open(os.path.join(sys.argv[1], "ops-17-default.jsonl")):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    t[r["op"]] = r["fwd_bwd_ms"]
sys.exit(0 if t.get("layer_op", 1e9) < t.get("layer_sink", 0) else 1)
PY
then LAYER=op; fi
export GRPO_GPU_LAYER=$LAYER
log "kit with GRPO_GPU_KERNELS=$BEST GRPO_GPU_ATTENTION=$GRPO_GPU_ATTENTION GRPO_GPU_DECODE=${GRPO_GPU_DECODE:-kernel} GRPO_GPU_LAYER=$LAYER"
export GRPO_GPU_KERNELS=$BEST GRPO_PROFILE=1
BUDGET=$((${BUDGET:-530} - (SECONDS - T0))) OUT=$FIN bash .gpu/run.sh
# The update's throughput and MFU (time/update_tflops, time/update_mfu) of each kit run, from
# step 2.
python3 - $FIN >> $FIN/ops-summary.txt 2>&1 <<'PY'
import glob, json, os, statistics, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "grpo-*.metrics.jsonl"))):
    rows = [json.loads(l) for l in open(path) if '"loss"' in l]; r = rows[1:] or rows
    m = lambda k: round(statistics.median(x[k] for x in r), 3) if r and all(k in x for x in r) else "-"
    print("   ", os.path.basename(path), "update TFLOP/s", m("time/update_tflops"), "MFU", m("time/update_mfu"))
PY
# Each run's memory by phase (GRPO_PROFILE's `profile memory:` lines, the largest over its
# steps): what tensors used at most, and what CUDA's pool held at most.
memory() {
  python3 - "$@" >> $FIN/ops-summary.txt 2>&1 <<'PY'
import os, re, sys
pat = re.compile(r"profile memory: (.*?): peak ([0-9.]+) GB, .*held up to ([0-9.]+) GB")
for path in [p for p in sys.argv[1:] if os.path.exists(p)]:
    most = {}
    for line in open(path, errors="replace"):
        m = pat.search(line)
        if m:
            used, held = most.get(m[1], (0.0, 0.0))
            most[m[1]] = (max(used, float(m[2])), max(held, float(m[3])))
    for phase, (used, held) in most.items():
        print(f"    {os.path.basename(path)} memory {phase}: in use {used:.2f} GB, pool held {held:.2f} GB")
PY
}
memory $FIN/grpo-*.log
# EXTRA=1: after the kit, while the budget lasts: the small f32 shape again with gradient
# checkpointing (what TRL's peer runs with), for its peak memory and step time; three reads of
# that shape's peak (CUDA's pool trimmed between phases, releasing at every synchronization, and
# passes of 512 tokens); when the kit ran the one-op layer, the 1.7B shape again through candle's
# graph (GRPO_GPU_LAYER=graph), the op's A/B in one call; then the 1.7B shape with gradient
# checkpointing (TRL's default: what it costs there decides whether grpo's GPU default should
# follow it).
left() { echo $((${BUDGET:-530} + T0 - SECONDS)); }
extra() {  # name model-dir timeout env-assignment grpo-args...
  local name=$1 m=$2 to=$3 env=$4; shift 4
  [ "${EXTRA:-0}" = 1 ] && [ $(left) -gt $to ] && [ -d $m ] || { log "extra $name skipped"; return; }
  log "extra: grpo $name ($env $*)"
  rm -f $FIN/mem-$name.txt
  (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> $FIN/mem-$name.txt; sleep 0.5; done) & PP=$!
  env $env timeout $to $G/bin/grpo train --config $G/kit/grpo_gpu.toml --model=$m --train_file=/tmp/data.jsonl \
    --output_dir=/tmp/o-$name --device=cuda "$@" > $FIN/grpo-$name.log 2>&1
  echo "   rc=$?" >> $FIN/ops-summary.txt; kill $PP 2>/dev/null; wait $PP 2>/dev/null
  echo "   peak GPU memory: $(sort -n $FIN/mem-$name.txt | tail -1) MiB" >> $FIN/ops-summary.txt
  python3 - /tmp/o-$name/metrics.jsonl >> $FIN/ops-summary.txt 2>&1 <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]; r = rows[1:] or rows
m = lambda k: round(statistics.median(x.get(k, 0) for x in r), 3)
print("   grpo from step 2, median s: step", m("time/step"), "gen", m("time/generate"), "ref", m("time/reference"), "update", m("time/update"), "| update TFLOP/s", m("time/update_tflops"), "MFU", m("time/update_mfu"))
PY
  rm -rf /tmp/o-$name
}
extra s135-f32-ckpt /tmp/m-135m 60 GRPO_GPU_LAYER=$LAYER --max_steps=5 --dtype=f32 --gradient_checkpointing=true
# Three more reads of the small f32 shape's peak (6.9 GB in passes of ~1.9k tokens, TRL 3.8),
# ~20 s each: CUDA's pool handing its free memory back at the end of each phase of a step
# (GRPO_CUDA_POOL=trim) and at every synchronization (=release): how much of the peak is freed
# memory the pool kept (the `profile memory:` lines say it too, as what the pool held); and in
# passes of 512 tokens: how far smaller passes bring it down, and what they cost.
extra s135-f32-trim /tmp/m-135m 45 GRPO_CUDA_POOL=trim --max_steps=5 --dtype=f32
extra s135-f32-release /tmp/m-135m 45 GRPO_CUDA_POOL=release --max_steps=5 --dtype=f32
extra s135-f32-512 /tmp/m-135m 45 GRPO_GPU_LAYER=$LAYER --max_steps=5 --dtype=f32 --forward_chunk_tokens=512
[ $LAYER = op ] && extra l17-bf16-graph /tmp/m-1.7b 90 GRPO_GPU_LAYER=graph --max_steps=3 --dtype=bf16 \
  --num_generations=8 --per_device_train_batch_size=128 --max_completion_length=256
extra l17-bf16-ckpt /tmp/m-1.7b 90 GRPO_GPU_LAYER=$LAYER --max_steps=3 --dtype=bf16 \
  --num_generations=8 --per_device_train_batch_size=128 --max_completion_length=256 --gradient_checkpointing=true
memory $FIN/grpo-s135-f32-*.log $FIN/grpo-l17-bf16-*.log
log "extras done"
