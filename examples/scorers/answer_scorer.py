#!/usr/bin/env python3
"""Example reward scorer for grpo's `kind = "command"` rewards: is the last number of the
completion the reference answer?

    [[rewards]]
    kind = "command"
    name = "correct"
    command = ["python3", "examples/scorers/answer_scorer.py"]

Protocol (docs/rewards.md (Scorer programs)): grpo writes one JSON request per line on our stdin,

    {"id": 17, "prompt": "...", "completion": "...", "answer": "42", "metadata": {...}}

(or, with `batch_size` > 1, a JSON array of such requests on one line), and reads one answer per
request from our stdout, in any order:

    {"id": 17, "reward": 1.0}        # or "reward": null when this completion cannot be scored

Rules a scorer must keep:
  * write answers to stdout only, one JSON value per line, and flush after each line;
    logs and debugging output go to stderr (grpo shows them in its log);
  * answer a batch line with one JSON array holding a response for every request in it;
  * keep running until stdin ends (EOF), then exit.

Rewards: 1.0 when the last number in the completion equals the answer (commas in numbers such as
1,234 are ignored, 12.0 equals 12), 0.0 otherwise, null when the example has no answer.
Only the standard library is used.
"""
import json
import re
import sys

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text):
    found = NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def reward(request):
    answer = request.get("answer")
    if answer is None:
        return None  # missing: left out of the group's statistics, not a zero
    want = last_number(str(answer))
    got = last_number(request.get("completion", ""))
    if want is None:  # a non-numeric answer: compare the text
        return 1.0 if request.get("completion", "").strip().rstrip(".") == str(answer).strip() else 0.0
    return 1.0 if got is not None and abs(got - want) <= 1e-9 * max(1.0, abs(want)) else 0.0


def main():
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if isinstance(message, list):  # batch_size > 1: one array in, one array out
            out = [{"id": r["id"], "reward": reward(r)} for r in message]
        else:
            out = {"id": message["id"], "reward": reward(message)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
