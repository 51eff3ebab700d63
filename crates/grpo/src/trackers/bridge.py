# grpo's bridge to the user's own `wandb` or `trackio` package (the library is the first
# argument): JSON lines on stdin, one answer line on stdout after "init". Messages: {"init":
# {project, name, id, config, dir, resume}}, {"row": {...}} (a sampled completion with its "step";
# a step's rows go as one table at that step), {"log": {metric: value}, "step": n},
# {"finish": exit_code}. Anything that fails is reported as {"error": "..."} and ends the bridge.
import json
import sys

LIBRARY = sys.argv[1] if len(sys.argv) > 1 else "wandb"

# Answers go to the real stdout; anything wandb prints goes to stderr.
OUT = sys.stdout
sys.stdout = sys.stderr


def answer(obj):
    OUT.write(json.dumps(obj) + "\n")
    OUT.flush()


try:
    if LIBRARY == "trackio":
        import trackio as wandb  # the same init / log / Table / finish calls
    else:
        import wandb
except Exception as e:  # noqa: BLE001
    answer({"error": f"cannot import {LIBRARY} with {sys.executable} ({e}): pip install {LIBRARY}, "
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
            if LIBRARY == "trackio":
                # Trackio names runs (no ids): a resumed run continues the run of that name.
                run = wandb.init(project=a.get("project"), name=a.get("name"),
                                 resume="allow" if a.get("resume") else "never",
                                 config=a.get("config"), embed=False)
                answer({"ok": True, "id": run.name, "mode": "local"})
            else:
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
            if LIBRARY == "trackio":
                wandb.finish()
            else:
                run.finish(exit_code=m["finish"])
            run = None
            break
except Exception as e:  # noqa: BLE001
    answer({"error": f"{type(e).__name__}: {e}"})
    sys.exit(4)
finally:
    if run is not None:
        wandb.finish() if LIBRARY == "trackio" else run.finish(exit_code=1)
