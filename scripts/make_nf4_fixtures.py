"""NF4 fixtures: bitsandbytes' own 4-bit NormalFloat quantization (QLoRA's type) of fixed
weights, which grpo's `base_quantization = "nf4"` must reproduce code for code.

    /opt/peers/venv/bin/pip install bitsandbytes   # 0.50 quantizes on the CPU
    /opt/peers/venv/bin/python scripts/make_nf4_fixtures.py

Writes tests/fixtures/nf4/nf4.safetensors:
  weight_<name>    the f32 weight [out, in]
  packed_<name>    bitsandbytes' packed codes, uint8 [ceil(out * in / 2)] (two codes per byte)
  absmax_<name>    the f32 absmax of each block of 64 values (flattened; the last may be short)
  dequant_<name>   bitsandbytes' dequantization, f32 [out, in]
  code             the 16 NF4 values
"""
import json
import os

import bitsandbytes
import torch
from bitsandbytes.functional import dequantize_4bit, quantize_4bit
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "nf4")

torch.manual_seed(0)
weights = {
    "small": torch.randn(8, 128),
    "wide": torch.randn(16, 576) * 0.02,  # SmolLM2's hidden size
    "outliers": torch.randn(4, 192) * torch.tensor([1.0, 10.0, 0.001, 3.0]).unsqueeze(1),
    "partial": torch.randn(5, 33),  # 165 values: blocks across rows, a short last block
}
weights["outliers"][0, 5] = 0.0
weights["outliers"][1, :64] = 0.0  # an all-zero block
out = {}
for name, w in weights.items():
    w = w.float().contiguous()
    q, st = quantize_4bit(w, blocksize=64, quant_type="nf4")
    out[f"weight_{name}"] = w
    out[f"packed_{name}"] = q.flatten().contiguous()
    out[f"absmax_{name}"] = st.absmax.float().contiguous()
    out[f"dequant_{name}"] = dequantize_4bit(q, st).float().contiguous()
    code = st.code.float().contiguous()
out["code"] = code
os.makedirs(OUT, exist_ok=True)
save_file(out, os.path.join(OUT, "nf4.safetensors"))
with open(os.path.join(OUT, "versions.json"), "w") as f:
    json.dump({"bitsandbytes": bitsandbytes.__version__, "torch": torch.__version__}, f, indent=1)
print(f"wrote {len(weights)} weights to {OUT}")
