"""What peft and transformers make of grpo's files (tests/fixtures/interop, written by grpo's
test `peft_and_transformers_load_what_grpo_writes` with GRPO_BLESS=1):

  adapter/       a LoRA adapter with target_modules = "all-linear" over tests/fixtures/tiny/qwen2
  merged_bf16/   that adapter merged into the base by `grpo export --merge --dtype bf16
                 --max-shard-size`, in shards with an index

This script loads them with peft and transformers (nothing of grpo's runs here) and writes
  expected.json          the modules peft put adapters on, transformers' and peft's greedy tokens
  expected.safetensors   peft's adapted logits for the prompt
which the Rust test compares with grpo's own.

    /opt/peers/venv/bin/python scripts/check_interop.py
"""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import PeftModel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.path.join(ROOT, "tests", "fixtures", "interop")
BASE = os.path.join(ROOT, "tests", "fixtures", "tiny", "qwen2")
PROMPT = [3, 17, 42, 9, 88, 5]
torch.manual_seed(0)


def greedy(model):
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                         min_new_tokens=8, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


base = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
model = PeftModel.from_pretrained(base, os.path.join(DIR, "adapter")).eval()
modules = sorted(n.removeprefix("base_model.model.") for n, m in model.named_modules()
                 if hasattr(m, "lora_A") and len(getattr(m, "lora_A")) > 0)
with torch.no_grad():
    logits = model(torch.tensor([PROMPT])).logits[0].float().contiguous()
peft_greedy = greedy(model)

# The bf16 export: transformers reads the shards through the index; computed in f32.
merged = AutoModelForCausalLM.from_pretrained(os.path.join(DIR, "merged_bf16"),
                                              dtype=torch.float32).eval()
export_greedy = greedy(merged)
with torch.no_grad():
    merged_logits = merged(torch.tensor([PROMPT])).logits[0].float()

save_file({"peft_logits": logits}, os.path.join(DIR, "expected.safetensors"))
with open(os.path.join(DIR, "expected.json"), "w") as f:
    json.dump({
        "prompt_ids": PROMPT,
        "peft_lora_modules": modules,
        "peft_greedy": peft_greedy,
        "transformers_bf16_export_greedy": export_greedy,
        # By hand: how far the bf16 export's logits are from the f32 adapter's.
        "bf16_export_vs_peft_max_logit_diff": (merged_logits - logits).abs().max().item(),
        "versions": {"peft": peft.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
    }, f, indent=1)
print(f"{len(modules)} adapted modules; peft greedy {peft_greedy}; export greedy {export_greedy}")
