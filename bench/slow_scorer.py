#!/usr/bin/env python3
# A slow scorer program for bench/configs/slow_scorer.toml: 100 ms of waiting per completion, then
# the last-number check (JSON lines protocol, docs/rewards.md (Scorer programs)).
import json, sys, time, re
for line in sys.stdin:
    r = json.loads(line)
    time.sleep(0.1)  # a slow check: 100 ms per completion (e.g. running tests in a sandbox)
    nums = re.findall(r"-?\d+", r["completion"])
    ok = bool(nums) and r.get("answer") is not None and nums[-1] == str(r["answer"]).strip()
    print(json.dumps({"id": r["id"], "reward": 1.0 if ok else 0.0}), flush=True)
