"""Writes tests/fixtures/trl/keys.json: every key of TRL's GRPOConfig (with the HF
TrainingArguments it inherits) and of `trl grpo`'s script and model arguments, with TRL's
default where it is plain JSON. grpo's config tests load each key at its default, and
docs/config.md's key table is checked against this list.

    /opt/peers/venv/bin/python scripts/dump_trl_keys.py
"""
import dataclasses
import enum
import json
import pathlib

import transformers
import trl
from transformers import TrainingArguments
from trl import GRPOConfig, ModelConfig
from trl.scripts.grpo import GRPOScriptArguments


def plain(v):
    if isinstance(v, enum.Enum):
        v = v.value
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    if isinstance(v, dict) and not v:
        return {}
    return None


def default(f):
    if f.default is not dataclasses.MISSING:
        return plain(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return plain(f.default_factory())
    return None


def fields(cls, origin):
    return [
        {"key": f.name, "origin": origin, "default": default(f)}
        for f in dataclasses.fields(cls)
        if not f.name.startswith("_")
    ]


base = {f.name for f in dataclasses.fields(TrainingArguments)}
grpo = fields(GRPOConfig, "GRPOConfig")
for k in grpo:  # GRPOConfig's defaults, also where it overrides TrainingArguments'
    if k["key"] in base:
        k["origin"] = "TrainingArguments"
keys = (
    grpo
    + fields(GRPOScriptArguments, "script")
    + fields(ModelConfig, "model")
)
out = {
    "trl": trl.__version__,
    "transformers": transformers.__version__,
    "keys": keys,
}
path = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/trl/keys.json"
path.write_text(json.dumps(out, indent=1) + "\n")
print(f"{len(keys)} keys -> {path}")
