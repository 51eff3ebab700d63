#!/usr/bin/env python3
"""The TRL peer's GRPO step (../shared/bench/peers/trl_grpo_bench.py) with a peft LoRA adapter:
same task, model, batch and JSON output, plus `peft_config` (the reference is then the base with
adapters disabled, as in grpo). Extra options: --lora-r, --lora-alpha, --lora-dropout, --targets.

    /opt/peers/venv/bin/python bench/trl_lora_step.py --steps 5 --prompts 8 --generations 4 \
        --max-tokens 64 --seed 0 --lr 2e-5 --beta 0.04 --lora-r 16 --lora-alpha 32
"""
import argparse
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
peers = os.environ.get("PEERS_SRC", os.path.join(here, "..", "..", "shared", "bench", "peers"))
sys.path.insert(0, peers)
import trl_grpo_bench as tb  # noqa: E402
from peft import LoraConfig  # noqa: E402

ap = argparse.ArgumentParser(add_help=False)
ap.add_argument("--lora-r", type=int, default=16)
ap.add_argument("--lora-alpha", type=float, default=32)
ap.add_argument("--lora-dropout", type=float, default=0.05)
ap.add_argument("--targets", default="q_proj,v_proj")
lora_args, rest = ap.parse_known_args()
sys.argv = [sys.argv[0]] + rest

peft_config = LoraConfig(r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha,
                         lora_dropout=lora_args.lora_dropout, bias="none", task_type="CAUSAL_LM",
                         target_modules=lora_args.targets.split(","))


class LoraTrainer(tb.TimedGRPOTrainer):
    def __init__(self, *a, **kw):
        kw["peft_config"] = peft_config
        super().__init__(*a, **kw)


tb.TimedGRPOTrainer = LoraTrainer
tb.main()
