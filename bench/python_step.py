"""The GRPO step from Python: GRPOTrainer on bench/configs/trl_peer.toml's run, as
bench/python_step.sh compares it with `grpo train` on the same run.

    python bench/python_step.py --config bench/configs/trl_peer.toml --model DIR --data rows.jsonl \
        --out DIR --steps 8 --rewards config|python

--rewards config: the config's own [[rewards]] (computed in the library): what the Python layer
adds to a step. --rewards python: Python twins of them as reward functions, called in process.
"""
import argparse
import json
import re
import tomllib

from grpo import GRPOConfig, GRPOTrainer


def correctness(completions, answer, **kwargs):
    """1.0 when the answer appears in the completion as an integer of its own."""
    return [1.0 if re.search(rf"(?<![\d]){re.escape(str(a))}(?![\d])", c) else 0.0
            for c, a in zip(completions, answer)]


def format(completions, **kwargs):  # noqa: A001 (the config's reward name)
    """0.1 when the whole completion is an integer (optionally with a period)."""
    return [0.1 if re.fullmatch(r"\s*-?\d+\.?\s*", c) else 0.0 for c in completions]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rewards", choices=["config", "python"], default="config")
    a = p.parse_args()
    with open(a.config, "rb") as f:
        fields = tomllib.load(f)
    tables = fields.pop("rewards")
    fields.update(output_dir=a.out, max_steps=a.steps)
    rows = [json.loads(line) for line in open(a.data)]
    reward_funcs = tables if a.rewards == "config" else [correctness, format]
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward_funcs, args=GRPOConfig(**fields),
                          train_dataset=rows)
    trainer.train()


if __name__ == "__main__":
    main()
