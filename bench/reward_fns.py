"""Reward functions for bench/reward_throughput.sh, in TRL's signature
f(prompts, completions, **kwargs) -> list[float]; grpo calls them through
examples/scorers/trl_adapter.py, TRL calls them in its own process.
"""
import re
import time

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text):
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def last_number_reward(prompts, completions, answer, **kwargs):
    """Cheap rule: 1.0 when the completion's last number is the answer."""
    return [1.0 if _last_number(c) == float(a) else 0.0 for c, a in zip(completions, answer)]


def slow_reward(prompts, completions, answer, **kwargs):
    """A slow judge: the same rule after 2 ms of waiting per completion (an I/O-bound check)."""
    out = []
    for c, a in zip(completions, answer):
        time.sleep(0.002)
        out.append(1.0 if _last_number(c) == float(a) else 0.0)
    return out
