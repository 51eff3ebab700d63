#!/bin/bash
# Issue 59's long, uneven completions on a GPU: bench/long_step.sh (grpo against TRL with HF
# generate and with transformers' continuous batching, one random-weight model with an EOS rate)
# at the 1.7B shape, 16 prompts x 8, bf16, caps 1024 then 4096, from the GPU kit's binaries and
# wheels. After ../shared/gpu/build_cuda.sh and ../shared/gpu/pack.sh here; on the GPU machine,
# from the project root with .gpu/ carried along:
#   OUT=$OUT bash scripts/gpu_long.sh            (CAPS="1024 4096", STEPS=3, SHAPE=1.7b,
#                                                 RUNS="grpo trl trl-cb", BUDGET=540 seconds)
# Each cap's runs are skipped once the budget is spent. Results: $OUT/long-step-cuda-*.
set -u
T0=$SECONDS; ROOT=$PWD; G=$ROOT/.gpu; FIN=${OUT:-$ROOT/gpu-out}; mkdir -p "$FIN"
SITE=$(python3 -c 'import sys; print([p for p in sys.path if p.endswith("site-packages")][0])')
NV=$(find "$SITE/nvidia" -name "lib*.so*" -printf "%h\n" 2>/dev/null | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH=$NV/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$G"/whl/*.whl > "$FIN/pip.txt" 2>&1
python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open('/tmp/grpo-long','wb'))" "$G/bin/grpo.xz"
chmod +x /tmp/grpo-long
export PYTHONPATH=/tmp/site PEERS_SRC=$G/peers GRPO_BIN=/tmp/grpo-long PEER_PYTHON=python3
export DEVICE=cuda BF16=1 RUNS=${RUNS:-grpo trl trl-cb}
for cap in ${CAPS:-1024 4096}; do
  left=$(( ${BUDGET:-540} - (SECONDS - T0) ))
  [ $left -lt 120 ] && { echo "cap $cap skipped ($left s left)" >> "$FIN/long-summary.txt"; continue; }
  echo "== [$((SECONDS - T0))s] cap $cap" >> "$FIN/long-summary.txt"
  timeout $left bash bench/long_step.sh "${STEPS:-3}" "$cap" 16 8 "${SHAPE:-1.7b}" >> "$FIN/long-summary.txt" 2>&1
done
cp bench/results/long-step-cuda-* "$FIN/" 2>/dev/null
echo "== [$((SECONDS - T0))s] done" >> "$FIN/long-summary.txt"
