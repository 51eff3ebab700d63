"""The structural type of a reward function's keyword argument, as
tests/fixtures/python/trl_reward_kwargs.json records TRL's (scripts/record_trl_reward_kwargs.py)
and the Python package's tests compare grpo's with (crates/grpo-py/tests/test_trainer.py).
No imports: the tests' Python has no torch.
"""


def describe(value):
    """Structural type of a value: lists by their first element, dicts by their sorted keys."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        name = type(value).__name__
        return f"{name}[{describe(value[0])}]" if value else f"{name}[]"
    if isinstance(value, dict):
        return "dict[" + ",".join(f"{k}:{describe(value[k])}" for k in sorted(value)) + "]"
    if type(value).__name__ == "Tensor" and hasattr(value, "dtype"):  # torch, not imported
        return f"Tensor[{str(value.dtype).removeprefix('torch.')}]"
    if callable(value) and not isinstance(value, type):
        return "callable"
    return type(value).__name__
