#!/usr/bin/env python3
"""Example scorer that *runs* model-written code: the completion's Python (its last ```python
fenced block, or the whole completion when there is none) is run in a fresh interpreter with a
time limit, and the reward is 1.0 when what it prints equals the example's answer, else 0.0
(null without an answer).

    [[rewards]]
    kind = "command"
    name = "code_runs"
    command = ["python3", "examples/scorers/run_code_scorer.py"]
    processes = 2          # two completions run at a time
    cpu_seconds = 3600     # RLIMIT_CPU of the scorer AND of every program it starts (each its own)
    memory_mb = 2048       # RLIMIT_AS, likewise per process
    no_network = true      # the scorer and the code it runs see no network

The limits come from grpo (see docs/rewards.md (Scorer programs)); this scorer adds a wall-clock limit per
program (CODE_TIMEOUT_S, default 5 s) and runs each one in its own temporary directory with
Python's isolated mode (-I). This is containment against accidents, not a security boundary: run
untrusted code in a container or VM as well.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

TIMEOUT = float(os.environ.get("CODE_TIMEOUT_S", "5"))
FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def code_of(completion):
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def reward(request):
    answer = request.get("answer")
    if answer is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run = subprocess.run(
                [sys.executable, "-I", "-c", code_of(request["completion"])],
                cwd=tmp, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            return 0.0
    return 1.0 if run.returncode == 0 and run.stdout.strip() == str(answer).strip() else 0.0


def main():
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if isinstance(message, list):
            out = [{"id": r["id"], "reward": reward(r)} for r in message]
        else:
            out = {"id": message["id"], "reward": reward(message)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
