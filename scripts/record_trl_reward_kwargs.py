#!/usr/bin/env python3
"""Records which keyword arguments TRL's GRPOTrainer passes to Python reward functions.

Usage:
    /opt/peers/venv/bin/python scripts/record_trl_reward_kwargs.py \
        [--model /opt/peers/smollm2-135m-instruct-f32] \
        [--out tests/fixtures/python/trl_reward_kwargs.json]

Runs one real training step of `trl.GRPOTrainer` (SmolLM2-135M-Instruct, on the CPU, about a
minute on 2 cores) per dataset, with two reward functions that only look at what they are given:
`sync_recorder` (a plain function) and `async_recorder` (an `async def`, which TRL runs on its
daemon event loop). Both keep the kwargs of their first call and return 0.0 per completion.

Datasets (in memory, 2 rows each, extra columns `answer` str, `level` int, `tags` list[str]):
  standard        `prompt` is a plain string
  conversational  `prompt` is `[{"role": "user", "content": ...}]`

Trainer: per_device_train_batch_size=4, num_generations=2 (so 2 prompts x 2 completions in one
generation batch), max_completion_length=8, max_steps=1, seed=0.

Running on the CPU needs `use_cpu=True` and `bf16=False` (GRPOConfig otherwise asks for bf16
mixed precision) and nothing else: TRL generates with `model.generate` (no vLLM), there is no
reference model (beta defaults to 0.0), and `report_to="none"` / `save_strategy="no"` keep it
from logging to trackers or writing checkpoints (output_dir is a temporary directory).

Writes (deterministic: sampling is seeded by `seed=0`; rerunning on the same torch build gives
the same file) a JSON file with, per dataset and per recorder ("sync", "async"):
  kwargs          sorted keyword names received
  types           kwarg -> structural type string (see `describe`)
  prompts         the `prompts` kwarg as received
  columns         every kwarg that is a dataset column (answer, level, tags) as received
  num_items       len(prompts)
  num_calls       how many times the recorder was called during the step
  trainer_state   class name, global_step at the first call, max_steps, public attribute names
  completion_ids_end_with_eos
                  the tokenizer's eos id, TRL's eos ids, per item len(completion_ids[i]) and
                  whether it ends with eos, and whether every completion that stopped before
                  max_completion_length ends with eos
  completions_example   completions[0] as received
  completions     every completion as received (a stop on EOS decodes to no text)
  log_extra_signature / log_metric_signature   str(inspect.signature(...))
and at the top level the versions of trl, transformers, torch and datasets.
"""

import argparse
import inspect
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

import transformers  # noqa: E402
from trl_kwargs_types import describe  # noqa: E402 (scripts/, the script's directory)
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MAX_COMPLETION_LENGTH = 8

ROWS = [
    {"prompt": "What is 2 + 3? Answer with a number.", "answer": "5", "level": 1, "tags": ["math", "add"]},
    {"prompt": "What is 7 - 4? Answer with a number.", "answer": "3", "level": 2, "tags": ["math"]},
]

COLUMNS = ["answer", "level", "tags"]


def jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return repr(value)


class Recorder:
    """Keeps a snapshot of the first call's kwargs, taken inside the call."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def record(self, kwargs):
        self.calls += 1
        if self.first is None:
            state = kwargs.get("trainer_state")
            self.first = {
                "kwargs": dict(kwargs),
                # TrainerState is mutated as training goes on: read it now
                "global_step": getattr(state, "global_step", None),
                "max_steps": getattr(state, "max_steps", None),
                "state_attributes": sorted(k for k in vars(state) if not k.startswith("_")) if state else None,
                "state_type": type(state).__name__,
            }
        return [0.0] * len(kwargs["prompts"])


SYNC = Recorder()
ASYNC = Recorder()


def sync_recorder(**kwargs):
    return SYNC.record(kwargs)


async def async_recorder(**kwargs):
    return ASYNC.record(kwargs)


def summarize(rec, eos_token_id, trl_eos_ids):
    first = rec.first
    kw = first["kwargs"]
    ids = kw.get("completion_ids") or []
    items = [
        {"len": len(c), "ends_with_eos": bool(c) and c[-1] == eos_token_id}
        for c in ids
    ]
    stopped = [it for it in items if it["len"] < MAX_COMPLETION_LENGTH or it["ends_with_eos"]]
    out = {
        "kwargs": sorted(kw),
        "types": {k: describe(v) for k, v in sorted(kw.items())},
        "prompts": jsonable(kw.get("prompts")),
        "columns": {k: jsonable(kw[k]) for k in COLUMNS if k in kw},
        "num_items": len(kw.get("prompts") or []),
        "num_calls": rec.calls,
        "trainer_state": {
            "type": first["state_type"],
            "global_step": first["global_step"],
            "max_steps": first["max_steps"],
            "attributes": first["state_attributes"],
        },
        "completion_ids_end_with_eos": {
            "eos_token_id": eos_token_id,
            "trl_eos_token_ids": trl_eos_ids,
            "max_completion_length": MAX_COMPLETION_LENGTH,
            "items": items,
            "num_stopped": len(stopped),
            # None when no completion stopped before max_completion_length
            "all_stopped_end_with_eos": all(it["ends_with_eos"] for it in stopped) if stopped else None,
        },
        "completions_example": jsonable(kw["completions"][0]) if kw.get("completions") else None,
        "completions": jsonable(kw.get("completions")),
    }
    for name in ("log_extra", "log_metric"):
        if callable(kw.get(name)):
            out[f"{name}_signature"] = str(inspect.signature(kw[name]))
    return out


def run(model, rows, eos_token_id):
    SYNC.__init__()
    ASYNC.__init__()
    ds = Dataset.from_list(rows)
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=MAX_COMPLETION_LENGTH,
            max_steps=1,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            seed=0,
            bf16=False,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=[sync_recorder, async_recorder], args=args, train_dataset=ds
        )
        trainer.train()
        trl_eos_ids = [int(i) for i in trainer.eos_token_ids]
    assert SYNC.first is not None and ASYNC.first is not None, "a recorder was never called"
    return {
        "sync": summarize(SYNC, eos_token_id, trl_eos_ids),
        "async": summarize(ASYNC, eos_token_id, trl_eos_ids),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/opt/peers/smollm2-135m-instruct-f32")
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "python", "trl_reward_kwargs.json"))
    a = ap.parse_args()

    eos_token_id = AutoTokenizer.from_pretrained(a.model).eos_token_id
    conversational = [dict(r, prompt=[{"role": "user", "content": r["prompt"]}]) for r in ROWS]
    out = {
        "model": os.path.basename(os.path.normpath(a.model)),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "datasets": datasets.__version__,
        },
        "standard": run(a.model, ROWS, eos_token_id),
        "conversational": run(a.model, conversational, eos_token_id),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
