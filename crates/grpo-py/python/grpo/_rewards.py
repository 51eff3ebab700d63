"""Python reward functions, called in this process as TRL calls them.

The engine hands each batch (the completions of a round, or of one group while sampling goes
on) to a `Caller` as JSON; the caller calls the function with TRL's keyword arguments

    f(prompts=[...], completions=[...], completion_ids=[[...]], trainer_state=state,
      log_extra=..., log_metric=..., <every dataset column>=[...])

and checks what it returns: one float (or None: missing) per completion. `async def` functions
of one batch are awaited together (`asyncio.gather`), as TRL does.
"""

import asyncio
import concurrent.futures
import inspect
import json
import numbers
import threading
import traceback
import warnings


def reward_name(func):
    """The name a reward function's metrics carry: its `__name__` (TRL's names)."""
    name = getattr(func, "__name__", None) or type(func).__name__
    return name


def check_signature(func, name):
    """A function TRL could call: it takes keyword arguments (`**kwargs`, or `completions`).
    Raises TypeError naming the function otherwise, before training."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return
    params = sig.parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if "completions" not in names:
        raise TypeError(
            f"reward function '{name}{sig}' cannot be called as TRL calls reward functions: "
            "it must take the completions as a keyword argument, e.g. "
            f"def {name}(completions, **kwargs)")


class AsyncGroup:
    """The async reward functions of a trainer: the first of them asked to score a batch awaits
    all of them on it together; the others take their results."""

    def __init__(self):
        self.callers = []
        self.pending = {}
        self.lock = threading.Lock()

    def result(self, caller, key, kwargs):
        with self.lock:
            slot = self.pending.get(key)
            if slot is None or caller not in slot:
                slot = self._gather(kwargs)
                self.pending[key] = slot
            out = slot.pop(caller)
            if not slot:
                del self.pending[key]
        if isinstance(out, BaseException):
            raise out
        return out

    def _gather(self, kwargs):
        async def run():
            calls = [c.func(**kwargs) for c in self.callers]
            return await asyncio.gather(*calls, return_exceptions=True)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            results = asyncio.run(run())
        else:  # called under a running loop (a notebook's cell): a loop on a thread of its own
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                results = pool.submit(asyncio.run, run()).result()
        return dict(zip(self.callers, results))


class Caller:
    """Calls one reward function for the engine (`score(batch_json)`)."""

    def __init__(self, func, name, trainer, async_group, on_error):
        self.func = func
        self.name = name
        self.trainer = trainer
        self.on_error = on_error
        self.is_async = inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
            getattr(func, "__call__", None))
        self.async_group = async_group
        if self.is_async:
            async_group.callers.append(self)
        self.calls = 0

    def __call__(self, batch_json):
        batch = json.loads(batch_json)
        n = len(batch["prompts"])
        kwargs = dict(batch["columns"])
        kwargs.update(
            prompts=batch["prompts"],
            completions=batch["completions"],
            completion_ids=batch["completion_ids"],
            trainer_state=self.trainer.state,
            log_extra=self.trainer._log_extra,
            log_metric=self.trainer._log_metric,
        )
        self.calls += 1
        try:
            if self.is_async:
                out = self.async_group.result(self, batch_json, kwargs)
            else:
                out = self.func(**kwargs)
            return self.check(out, n)
        except Exception:
            if self.on_error != "missing":
                raise
            warnings.warn(f"reward function '{self.name}' raised; its {n} scores of this batch "
                          f"are missing (reward_errors = \"missing\"):\n{traceback.format_exc()}")
            return [None] * n

    def check(self, out, n):
        if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
            raise TypeError(f"reward function '{self.name}' returned {type(out).__name__} "
                            f"{out!r:.80}: return a list of {n} floats (None: no reward)")
        if hasattr(out, "tolist"):
            out = out.tolist()
        if len(out) != n:
            raise ValueError(
                f"The reward function '{self.name}' returned {len(out)} rewards, but {n} were "
                "expected (one per prompt-completion pair). Make sure the reward function "
                "returns exactly one reward per completion.")
        scores = []
        for i, x in enumerate(out):
            if x is None:
                scores.append(None)
            elif isinstance(x, numbers.Real) or hasattr(x, "__float__") and not isinstance(x, str):
                scores.append(float(x))
            else:
                raise TypeError(f"reward function '{self.name}' returned {x!r:.80} "
                                f"({type(x).__name__}) for completion {i}: return floats "
                                "(None: no reward)")
        return scores
