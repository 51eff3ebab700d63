"""Reward functions written as TRL's docs write them, for trl_grpo.yaml: each takes the batch's
completions (and any dataset column by name) and returns one float per completion."""
import re


def correct(completions, answer, **kwargs):
    """1.0 when the completion's last number is the reference answer."""
    rewards = []
    for completion, ref in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion)
        rewards.append(1.0 if numbers and numbers[-1] == str(ref).strip() else 0.0)
    return rewards


def short_answer(completions, **kwargs):
    """0.1 for an answer of at most 12 characters (the task wants just the number)."""
    return [0.1 if len(c.strip()) <= 12 else 0.0 for c in completions]
