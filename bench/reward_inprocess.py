"""TRL's way of computing a reward: one in-process call of the reward function over all the
completions (what GRPOTrainer does per reward function and step).

    python3 bench/reward_inprocess.py completions.jsonl bench/reward_fns.py:last_number_reward [REPS]

Prints one JSON line like reward_bench.rs does.
"""
import importlib.util
import json
import sys
import time


def load_function(target):
    """`file.py:name` -> (the function, its name)."""
    file, _, name = target.rpartition(":")
    spec = importlib.util.spec_from_file_location("reward_fns", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name), name


def main():
    path, target = sys.argv[1], sys.argv[2]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    f, name = load_function(target)
    rows = [json.loads(line) for line in open(path)]
    prompts = [r["prompt"] for r in rows]
    completions = [r["completion"] for r in rows]
    answers = [r["answer"] for r in rows]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        rewards = f(prompts=prompts, completions=completions, answer=answers, completion_ids=None)
        times.append(time.perf_counter() - t0)
    best = min(times)
    print(json.dumps({
        "bench": "reward", "case": f"trl_in_process:{name}", "n": len(rows),
        "score_s": [round(t, 6) for t in times], "best_s": round(best, 6),
        "per_s": round(len(rows) / best, 1), "mean_reward": sum(rewards) / len(rewards),
    }))


if __name__ == "__main__":
    main()
