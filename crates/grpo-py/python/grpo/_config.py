"""GRPOConfig: TRL's GRPOConfig fields, resolved by the same key table `grpo train` reads."""

import json
import math
import os
import warnings

from . import _grpo


def to_json_value(value, where):
    """A field's or a dataset cell's value as JSON data; numpy scalars and arrays, tuples, sets
    and paths become numbers, lists and strings. Anything else is a TypeError naming `where`."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        return {str(k): to_json_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    for attr in ("tolist", "item"):  # numpy / torch scalars and arrays
        if hasattr(value, attr):
            return to_json_value(getattr(value, attr)(), where)
    raise TypeError(f"{where}: {type(value).__name__} is not a value grpo can read "
                    "(give numbers, strings, booleans, lists or dicts)")


class GRPOConfig:
    """TRL's `GRPOConfig`, with the same field names: `GRPOConfig(output_dir="runs/x",
    learning_rate=1e-6, num_generations=8, max_steps=100, ...)`.

    Every field is checked when the config is made: an unknown field, or a value of the wrong
    type or out of range, raises ValueError naming it. Fields TRL has that do not apply here
    (vLLM, DeepSpeed, hub uploads, ...) are accepted with a warning saying why. Each field reads
    back as its resolved value (`args.learning_rate`), unset fields as their defaults;
    `grpo config --print` lists them all. Setting a field (`args.max_steps = 10`) checks it again.
    """

    def __init__(self, output_dir=None, **fields):
        if output_dir is not None:
            fields["output_dir"] = output_dir
        object.__setattr__(self, "_fields", {})
        object.__setattr__(self, "_values", {})
        self._resolve(fields)

    def _resolve(self, fields):
        data = {k: to_json_value(v, f"GRPOConfig.{k}") for k, v in fields.items()}
        resolved = json.loads(_grpo.resolve_config(json.dumps(data)))
        for key, why in resolved["ignored"]:
            warnings.warn(f"GRPOConfig: `{key}` is ignored by grpo ({why})", stacklevel=3)
        object.__setattr__(self, "_fields", dict(fields))
        object.__setattr__(self, "_values", resolved["values"])

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        if name.startswith("_"):
            raise AttributeError(name)
        # A known key that is unset (an optional one without default) reads as None.
        return None

    def __setattr__(self, name, value):
        self._resolve({**self._fields, name: value})

    def to_dict(self):
        """Every key's resolved value."""
        return dict(self._values)

    @property
    def fields(self):
        """The fields given (what `GRPOTrainer` sends to the engine)."""
        return dict(self._fields)

    def __repr__(self):
        given = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"GRPOConfig({given})"
