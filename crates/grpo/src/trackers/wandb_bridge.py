# grpo's bridge to the user's own `wandb` package: JSON lines on stdin, one answer line on stdout
# after "init". Messages: {"init": {project, name, id, config, dir}}, {"row": {...}} (a sampled
# completion with its "step"; a step's rows go as one table at that step), {"log": {metric:
# value}, "step": n},
# {"finish": exit_code}. Anything that fails is reported as {"error": "..."} and ends the bridge.
import json
import sys

# Answers go to the real stdout; anything wandb prints goes to stderr.
OUT = sys.stdout
sys.stdout = sys.stderr


def answer(obj):
    OUT.write(json.dumps(obj) + "\n")
    OUT.flush()


try:
    import wandb
except Exception as e:  # noqa: BLE001
    answer({"error": f"cannot import wandb with {sys.executable} ({e}): pip install wandb, "
                     "or set GRPO_PYTHON to a Python that has it"})
    sys.exit(3)

run = None
rows, columns, rows_step = [], None, None


def flush_rows():
    """The buffered completions as one table, at the step they were sampled in."""
    global rows
    if rows:
        run.log({"completions": wandb.Table(columns=columns, data=rows)}, step=rows_step)
        rows = []


try:
    for line in sys.stdin:
        m = json.loads(line)
        if "init" in m:
            a = m["init"]
            run = wandb.init(project=a.get("project"), name=a.get("name"), id=a.get("id"),
                             resume="allow", config=a.get("config"), dir=a.get("dir"))
            answer({"ok": True, "id": run.id, "mode": run.settings.mode})
        elif "row" in m:
            r = m["row"]
            if rows and r.get("step") != rows_step:
                flush_rows()
            rows_step = r.get("step")
            if columns is None:
                columns = [k for k in r]
            rows.append([json.dumps(r.get(k)) if isinstance(r.get(k), (dict, list)) else r.get(k)
                         for k in columns])
        elif "log" in m:
            flush_rows()
            run.log(m["log"], step=m["step"])
        elif "finish" in m:
            flush_rows()
            run.finish(exit_code=m["finish"])
            run = None
            break
except Exception as e:  # noqa: BLE001
    answer({"error": f"{type(e).__name__}: {e}"})
    sys.exit(4)
finally:
    if run is not None:
        run.finish(exit_code=1)
