"""Prints what Trackio stored locally for one project (TRACKIO_DIR), as JSON lines: {"runs": [...]},
then {"log": {...}} for every logged row of each run, then {"config": {...}} per run.

    python read_trackio.py PROJECT
"""
import json
import sys

from trackio.sqlite_storage import SQLiteStorage

project = sys.argv[1]
runs = SQLiteStorage.get_runs(project)
print(json.dumps({"runs": runs}))
for run in sorted(set(runs)):
    for row in SQLiteStorage.get_logs(project, run):
        print(json.dumps({"run": run, "log": row}, default=str))
    print(json.dumps({"run": run, "config": SQLiteStorage.get_run_config(project, run)}, default=str))
