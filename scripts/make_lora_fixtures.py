#!/usr/bin/env python3
"""LoRA reference fixtures from peft + transformers (CI does not run this; the outputs are committed).

Usage:
    /opt/peers/venv/bin/python scripts/make_lora_fixtures.py                 # write fixtures
    /opt/peers/venv/bin/python scripts/make_lora_fixtures.py --check DIR     # check grpo's files

Fixture mode writes, for each case below, tests/fixtures/lora/<case>/:
  adapter_config.json, adapter_model.safetensors   PEFT's own save_pretrained of the adapter
  expected.safetensors   input_ids [2, T] (i64), logits [2, T, V] of base + adapter, the loss
                         L = mean over rows and positions of log p(ids[t+1] | ids[..t]),
                         grad.<adapter key> = dL/d(adapter weight), and merged.<weight name> =
                         the projection weights after peft's merge_and_unload().
The bases are the committed tiny random checkpoints in tests/fixtures/tiny/. lora_B is set to
random values (PEFT starts it at zero, which would hide any mistake in B's use). Dropout is 0.

Check mode loads what grpo wrote (the Rust test `lora_files_for_peft_check`, run with
GRPO_LORA_CHECK_DIR=DIR, writes DIR/<case>/adapter (grpo's save of the adapter it loaded) and
DIR/<case>/merged (`grpo export --merge` output)) into peft / transformers, compares logits with
the fixture's, and writes tests/fixtures/lora/grpo_check.json with the max differences.
"""

import argparse
import json
import os
import shutil
import sys

import torch
import peft
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")

CASES = {
    # case: (base, peft LoraConfig kwargs)
    "llama_qv": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "qwen2_all_rslora": ("qwen2", dict(r=8, lora_alpha=4, target_modules="all-linear", use_rslora=True)),
    "gpt2_c_attn": ("gpt2", dict(r=4, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True)),
}


def load_base(name):
    m = AutoModelForCausalLM.from_pretrained(
        os.path.join(FIX, "tiny", name), torch_dtype=torch.float32, attn_implementation="eager"
    )
    m.eval()
    return m


def loss_of(logits, ids):
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    tok = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return tok.mean()


def make_case(case, base_name, kw, out):
    torch.manual_seed(1234)
    base = load_base(base_name)
    cfg = LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **kw)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.train()  # dropout is 0, so train mode only enables grads
    vocab = base.config.vocab_size
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    out_ = model(input_ids=ids)
    loss = loss_of(out_.logits, ids)
    loss.backward()
    d = os.path.join(out, case)
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d)
    os.remove(os.path.join(d, "README.md"))  # peft's generated model card
    conf_path = os.path.join(d, "adapter_config.json")
    with open(conf_path) as f:
        conf = json.load(f)
    conf["base_model_name_or_path"] = f"tests/fixtures/tiny/{base_name}"  # not this machine's path
    if isinstance(conf["target_modules"], list):
        conf["target_modules"] = sorted(conf["target_modules"])  # peft writes a set's order
    with open(conf_path, "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)
        f.write("\n")
    tensors = {"input_ids": ids.contiguous(), "logits": out_.logits.detach().contiguous(),
               "loss": loss.detach().reshape(1)}
    for n, p in model.named_parameters():
        if p.grad is not None:
            key = n.replace(".default", "")
            tensors["grad." + key] = p.grad.detach().contiguous()
    merged = model.merge_and_unload()
    sd = merged.state_dict()
    for n, t in sd.items():
        if any(x in n for x in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj", "c_attn", "c_proj", "c_fc")) and n.endswith("weight"):
            tensors["merged." + n] = t.detach().contiguous()
    save_file(tensors, os.path.join(d, "expected.safetensors"))
    print(case, "loss", float(loss), "grads", sum(k.startswith("grad.") for k in tensors))


def check(grpo_dir):
    report = {}
    for case, (base_name, _) in CASES.items():
        exp = load_file(os.path.join(FIX, "lora", case, "expected.safetensors"))
        ids = exp["input_ids"]
        r = {}
        adir = os.path.join(grpo_dir, case, "adapter")
        if os.path.isdir(adir):
            m = PeftModel.from_pretrained(load_base(base_name), adir)
            m.eval()
            with torch.no_grad():
                r["peft_loads_grpo_adapter_max_logit_diff"] = float(
                    (m(input_ids=ids).logits - exp["logits"]).abs().max())
        mdir = os.path.join(grpo_dir, case, "merged")
        if os.path.isdir(mdir):
            m = AutoModelForCausalLM.from_pretrained(mdir, torch_dtype=torch.float32,
                                                     attn_implementation="eager")
            m.eval()
            with torch.no_grad():
                r["transformers_loads_grpo_merged_max_logit_diff"] = float(
                    (m(input_ids=ids).logits - exp["logits"]).abs().max())
        report[case] = r
        print(case, r)
    report["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                          "peft": peft.__version__}
    with open(os.path.join(FIX, "lora", "grpo_check.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
        f.write("\n")
    bad = [c for c, r in report.items() if c != "versions"
           and (not r or any(v > 1e-4 for v in r.values()))]
    if bad:
        sys.exit(f"mismatch or missing output: {bad}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", metavar="DIR", help="check grpo's saved adapters / merged exports")
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    if a.check:
        check(a.check)
        return
    out = os.path.join(FIX, "lora")
    os.makedirs(out, exist_ok=True)
    for case, (base_name, kw) in CASES.items():
        make_case(case, base_name, kw, out)
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__,
                   "peft": peft.__version__}, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
