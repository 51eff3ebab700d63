#!/usr/bin/env python3
"""The shared TRL GRPO step peer (../shared/bench/peers/trl_grpo_bench.py) on a GPU.

That script pins TRL to the CPU (use_cpu=True, f32). This wrapper loads it unchanged and only
changes the GRPOConfig it builds: use_cpu=False where there is a GPU (accelerate then takes it)
and, with --bf16, TRL's bf16 mixed precision (on a machine without a GPU: the CPU with torch's
bf16 autocast, `bench/grpo_step.sh` with BF16=1). Two more switches for bench/long_step.sh:
--cb turns on TRL's transformers continuous batching (`use_transformers_continuous_batching`),
--varied swaps the peer's correctness reward for bench/varied_reward.py's `varied` (random-weight
models). Every other argument goes to the peer as is.
  bench/trl_step_device.py [--bf16] [--cb] [--varied] --steps 5 --prompts 8 ...
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

switches = {a: a in sys.argv for a in ["--bf16", "--cb", "--varied"]}
bf16 = switches["--bf16"]
sys.argv = [a for a in sys.argv if a not in switches]
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
    return config(**kw)


peer.GRPOConfig = on_device

print(f'{{"event": "device", "cuda": {str(torch.cuda.is_available()).lower()}, "bf16": {str(bf16).lower()}, '
      f'"continuous_batching": {str(switches["--cb"]).lower()}}}', flush=True)
peer.main()
