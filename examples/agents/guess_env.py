"""A guess-the-number game as an environment program (docs/agents.md, "Environments as programs
or services"): grpo starts it with `environment_command = ["python3", "examples/agents/guess_env.py"]`
and speaks JSON lines with it, one request per line on stdin, one answer per line on stdout.

  {"id": n, "op": "reset", "episode": e, "row": {...}} -> {"id": n, "observation": "Guess a number 1-9."}
  {"id": n, "op": "step", "episode": e, "action": "5"}  -> {"id": n, "observation": "higher", "reward": 0.0, "done": false}
  {"id": n, "op": "close", "episode": e}               -> {"id": n}

The row's `target` (else its `answer`) is the number; the first number in the model's turn is its
guess. A right guess ends the episode with reward 1; each wrong one costs 0.1. Any language works
the same way: nothing here is grpo's code.
"""

import json
import re
import sys

games = {}  # episode -> target


def answer(req):
    op, episode = req.get("op"), req.get("episode")
    if op == "reset":
        row = req.get("row") or {}
        try:
            games[episode] = int(row.get("target", row.get("answer")))
        except (TypeError, ValueError):
            return {"error": f"row has no integer target: {row!r}"[:200]}
        return {"observation": " Guess a number from 1 to 9: answer with the number only."}
    if op == "step":
        if episode not in games:
            return {"error": f"unknown episode {episode}"}
        target = games[episode]
        m = re.search(r"-?\d+", req.get("action") or "")
        if m is None:
            return {"observation": "Answer with a number from 1 to 9.", "reward": -0.1, "done": False}
        guess = int(m.group())
        if guess == target:
            return {"observation": "Correct!", "reward": 1.0, "done": True}
        hint = "higher" if guess < target else "lower"
        return {"observation": f"{guess} is wrong: {hint}.", "reward": -0.1, "done": False}
    if op == "close":
        games.pop(episode, None)
        return {}
    return {"error": f"unknown op {op!r}"}


def main():
    for line in sys.stdin:
        req = json.loads(line)
        out = answer(req)
        out["id"] = req.get("id")
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
