#!/usr/bin/env python3
"""The shared TRL GRPO step peer (../shared/bench/peers/trl_grpo_bench.py) on a GPU.

That script pins TRL to the CPU (use_cpu=True, f32). This wrapper loads it unchanged and only
changes the GRPOConfig it builds: use_cpu=False where there is a GPU (accelerate then takes it)
and, with --bf16, TRL's bf16 mixed precision (on a machine without a GPU: the CPU with torch's
bf16 autocast, `bench/grpo_step.sh` with BF16=1). Two more switches for bench/long_step.sh:
--cb turns on TRL's transformers continuous batching (`use_transformers_continuous_batching`),
--varied swaps the peer's correctness reward for bench/varied_reward.py's `varied` (random-weight
models). For issue 59's large shapes: --lora R adds a peft LoRA adapter of rank R (alpha 2R, no
dropout) on every linear layer ("all-linear"; the reference is then the base with the adapter
off, as in grpo), --qlora keeps that base in bitsandbytes' 4-bit NF4 (blocks of 64, bf16
compute; TRL's `quantization_config`), --bf16-weights loads the weights in bf16 instead of the
peer's f32 (what LoRA users do; with --bf16 alone TRL keeps f32 weights under bf16 autocast).
Every other argument goes to the peer as is.
  bench/trl_step_device.py [--bf16] [--cb] [--varied] [--bf16-weights] [--lora R [--qlora]] \
      --steps 5 --prompts 8 ...
"""
import importlib.util
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
peers = os.environ.get("PEERS_SRC", os.path.join(here, "..", "..", "shared", "bench", "peers"))
sys.path.insert(0, peers)
spec = importlib.util.spec_from_file_location("trl_grpo_bench", os.path.join(peers, "trl_grpo_bench.py"))
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)

switches = {a: a in sys.argv for a in ["--bf16", "--cb", "--varied", "--bf16-weights", "--qlora"]}
bf16 = switches["--bf16"]
sys.argv = [a for a in sys.argv if a not in switches]
lora_r = 0
if "--lora" in sys.argv:
    at = sys.argv.index("--lora")
    lora_r = int(sys.argv[at + 1])
    del sys.argv[at:at + 2]
if switches["--qlora"] and not lora_r:
    sys.exit("--qlora needs --lora R")
config = peer.GRPOConfig
if switches["--varied"]:
    sys.path.insert(0, here)
    from varied_reward import varied

    peer.correctness_reward = varied


import torch  # noqa: E402  (the peer imported it already)


def on_device(**kw):
    # On a machine without a GPU: the CPU, with torch's CPU autocast for --bf16.
    kw["use_cpu"] = not torch.cuda.is_available()
    kw["bf16"] = bf16
    kw["use_transformers_continuous_batching"] = switches["--cb"]
    if switches["--bf16-weights"] or switches["--qlora"]:
        kw["model_init_kwargs"] = {"dtype": "bfloat16"}
    return config(**kw)


peer.GRPOConfig = on_device

if lora_r:
    from peft import LoraConfig

    adapter = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, bias="none",
                         task_type="CAUSAL_LM", target_modules="all-linear")
    quant = None
    if switches["--qlora"]:
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=False)
    timed = peer.TimedGRPOTrainer

    class AdapterTrainer(timed):
        def __init__(self, *a, **kw):
            kw["peft_config"] = adapter
            if quant is not None:
                kw["quantization_config"] = quant
            super().__init__(*a, **kw)

    peer.TimedGRPOTrainer = AdapterTrainer

print(f'{{"event": "device", "cuda": {str(torch.cuda.is_available()).lower()}, "bf16": {str(bf16).lower()}, '
      f'"continuous_batching": {str(switches["--cb"]).lower()}, "lora": {lora_r}, '
      f'"qlora": {str(switches["--qlora"]).lower()}}}', flush=True)
peer.main()
