"""GRPO from Python: SmolLM2-135M-Instruct learns two-digit additions.

    pip install ./crates/grpo-py
    python examples/python/quickstart.py

Trains the default model (SmolLM2-135M-Instruct, fetched once) for 20 steps on 200 questions
made here (8 a step, 8 answers each), with one reward function: 1.0 when the last number of the
answer is the sum. Then it
evaluates the trained model on 50 held-out questions. Metrics and checkpoints go to
runs/python-quickstart/. docs/python.md describes the API.

Measured (2026-12-04, 2 cores, from a fresh clone's `pip install`: 5 minutes in all): the reward
went from 0.14 to 0.48 in 20 steps; on the held-out questions eval_accuracy 0.60 (greedy),
eval_pass@1 0.39 and eval_pass@4 0.72 (4 samples a question).
"""

import random
import re

from grpo import GRPOConfig, GRPOTrainer


def additions(n, rng):
    """Conversational prompts with the sum in the `answer` column."""
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({
            "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "answer": str(a + b),
        })
    return rows


def correct(completions, answer, **kwargs):
    """1.0 when the completion's last number equals the answer, else 0.0."""
    scores = []
    for completion, expected in zip(completions, answer):
        # Conversational prompts get completions as messages: [{"role": "assistant", "content": ...}]
        numbers = re.findall(r"-?\d+", completion[0]["content"])
        scores.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return scores


def main():
    rows = additions(250, random.Random(0))
    train, held_out = rows[:200], rows[200:]

    args = GRPOConfig(
        output_dir="runs/python-quickstart",
        max_steps=20,
        per_device_train_batch_size=64,   # 64 completions a step: 8 prompts x 8
        num_generations=8,
        max_completion_length=32,
        learning_rate=2e-5,               # crates/grpo/configs/default.toml's rate
        loss_type="dapo",
        eval_num_samples=4,               # eval_pass@1 and eval_pass@4 of 4 samples a question
        eval_k=[1, 4],
        correctness_reward="correct",     # eval_accuracy and eval_pass@k use this reward
    )
    trainer = GRPOTrainer(
        model=None,                       # SmolLM2-135M-Instruct
        reward_funcs=correct,
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
    )
    out = trainer.train()
    print(f"trained {out.global_step} steps, mean loss {out.training_loss:.4f}")
    for name, value in sorted(trainer.evaluate().items()):
        print(f"{name:>24}  {value}")


if __name__ == "__main__":
    main()
