"""grpo's in-process path for Python reward functions (GRPOTrainer's reward_funcs): the
completions handed from the library to the function's caller as training hands a round, one
call with all of them, timed in the library (the JSON batch, the GIL, the call, the checks).

    python bench/reward_inprocess_grpo.py completions.jsonl bench/reward_fns.py:last_number_reward [REPS]

Needs the package (`pip install ./crates/grpo-py`). Prints one JSON line as reward_bench.rs does.
"""
import json
import sys

from grpo import TrainerState, _grpo
from grpo._rewards import AsyncGroup, Caller
from reward_inprocess import load_function  # bench/, the script's directory


class _Trainer:
    """What a caller reads of its trainer."""

    state = TrainerState()

    def _log_metric(self, name, value):
        pass

    def _log_extra(self, column, values):
        pass


def main():
    path, target = sys.argv[1], sys.argv[2]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    f, name = load_function(target)
    rows = [json.loads(line) for line in open(path)]
    caller = Caller(f, name, _Trainer(), AsyncGroup(), "raise")
    times = _grpo.bench_reward(json.dumps(rows), caller, reps)
    best = min(times)
    print(json.dumps({
        "bench": "reward", "case": f"grpo_in_process:{name}", "n": len(rows),
        "score_s": [round(t, 6) for t in times], "best_s": round(best, 6),
        "per_s": round(len(rows) / best, 1),
    }))


if __name__ == "__main__":
    main()
