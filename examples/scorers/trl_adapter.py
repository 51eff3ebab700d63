#!/usr/bin/env python3
"""Serve a TRL-style reward function over grpo's scorer protocol, unchanged.

    [[rewards]]
    kind = "command"
    command = ["python3", "examples/scorers/trl_adapter.py", "my_rewards.py:correctness_reward"]
    batch_size = 64        # the function is called once per line, with up to 64 completions

The function is called as TRL calls its reward_funcs,

    f(prompts=[...], completions=[...], answer=[...], completion_ids=None, <metadata columns>=[...])
      -> list of float or None (None: missing)

with one list entry per request of the line. `my_rewards.py:name` loads a file; `package.module:name`
imports a module. Prompts are strings or lists of {role, content} messages, as in the dataset. An agent's
episode (a run with tools) comes as its list of messages (assistant turns with their tool_calls, tool
results), as TRL passes conversational completions.
"""
import importlib
import importlib.util
import json
import math
import sys


def load(target):
    where, _, name = target.rpartition(":")
    if not where or not name:
        sys.exit(f"usage: trl_adapter.py FILE.py:FUNCTION or MODULE:FUNCTION (got {target!r})")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location("reward_module", where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def call(f, requests):
    keys = sorted({k for r in requests for k in r.get("metadata", {})} - {"prompts", "completions", "answer"})
    columns = {k: [r.get("metadata", {}).get(k) for r in requests] for k in keys}
    out = f(
        prompts=[r["prompt"] for r in requests],
        # An agent's episode arrives as its messages too: TRL's conversational completions.
        completions=[r.get("completion_messages") or r["completion"] for r in requests],
        answer=[r.get("answer") for r in requests],
        completion_ids=None,
        **columns,
    )
    if len(out) != len(requests):
        raise ValueError(f"the reward function returned {len(out)} values for {len(requests)} completions")
    return [{"id": r["id"], "reward": None if x is None or not math.isfinite(x) else float(x)}
            for r, x in zip(requests, out)]


def main():
    f = load(sys.argv[1] if len(sys.argv) > 1 else "")
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        answers = call(f, message if isinstance(message, list) else [message])
        out = answers if isinstance(message, list) else answers[0]
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
