"""grpo's tool host: runs the user's Python tools and environment for agent episodes.

Started by grpo (crates/grpo/src/agents/tools.rs) as `python -c <this file> <spec-json>`, with
spec = {"tools": ["file.py:fn" | "pkg.module:fn", ...], "environment": "file.py:Cls" | null,
        "reward_functions": ["file.py:fn", ...], "max_result_chars": N, "check_schemas": bool}.
It reads one JSON request per line on stdin and writes one JSON answer per line to the original
stdout. Tools cannot disturb that channel: fd 1 and sys.stdout go to stderr, and fd 0 and
sys.stdin read from /dev/null, before any user code is imported.

First line written: {"ready": true}. Then, per request (the request's "id" is in every answer):
  {"op": "describe"}                            -> {"tools": [schema], "env_tools": [schema], "env_has_reward": b,
                                                    "env_reward_functions": [target]}
  {"op": "call", "tool", "arguments"}           -> {"result": str} | {"error": {"kind", "message"}}
  {"op": "reset", "episode", "row"}             -> {"result": str | null} | {"error"}
  {"op": "env_call", "episode", "tool", "arguments"} -> as "call", on the episode's environment
  {"op": "env_reward", "episode", "row", "messages"}
                                                -> {"reward": float | null[, "error"], "rewards": [float | null],
                                                    "errors": [{"kind", "message"} | null]}
  {"op": "close", "episode"}                    -> {"result": null}
Error kinds: raised, arguments, unknown_tool, environment_lost, env_reset, host.
A result is the returned str as is, else json.dumps(value), else str(value), cut to
max_result_chars with a "... [cut: N chars]" marker (N: the characters left out).

Environments follow TRL's `environment_factory` (trl/trainer/grpo_trainer.py): the factory is
called with no arguments; the class's public functions other than `reset` and `get_reward` are
tools; `reset(**row)` starts an episode and returns None or a string for the prompt;
`get_reward()` scores the episode ("reward"). The reward functions among "reward_functions" that
take an `environments` parameter (TRL passes `environments=` to every reward function) are called
here, where the instances live, once per episode, as TRL calls them, with one-element lists:
f(prompts=[prompt], completions=[messages], completion_ids=None, environments=[instance],
<every other column of the row>=[value]) ("rewards", in "env_reward_functions" order; the others
run in grpo's reward adapter). Instances are reused after `close` ("construct once, reset
often", as TRL's pool does). A start-up error is written to stderr, prefixed with `tools:` or
`environment_factory:`, and the process exits with status 2.
"""
import asyncio
import enum
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import sys
import traceback
import types
import typing

MAX_MESSAGE = 4000  # characters of an error message sent back


class StartError(Exception):
    """A problem with what the config names: reported at start, exit status 2."""

    def __init__(self, key, message):
        super().__init__(f"{key}: {message}")


# ---------------------------------------------------------------------------------------------
# JSON schemas, as transformers.utils.get_json_schema (5.x) writes them, for when transformers is
# not importable. Google-style docstrings: a description, then "Args:" and "Returns:" blocks.

_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS_BLOCK = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
# `name: text` lines; a deeper-indented `word:` continues the text of the argument above.
_ONE_ARG = re.compile(r"(?:^|\n)([ \t]*)(\w+):\s*(.*?)\s*(?=\n(?!\1[ \t])[ \t]*\w+:|\Z)", re.DOTALL)
_RETURNS_BLOCK = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {**_SCALARS, list: "array", tuple: "array", dict: "object"}


class SchemaError(TypeError):
    pass


def _enum_schema(values):
    if any(type(v) not in _SCALARS for v in values):
        raise SchemaError(f"enum values must be int, float, str, bool or None: {values!r}")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}


def _hint_schema(hint):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            values = [m.value for m in hint]
            if not values:
                raise SchemaError(f"the Enum {hint.__name__} has no members")
            return _enum_schema(values)
        if hint is typing.Any:
            return {}
        if hint in _BARE:
            return {"type": _BARE[hint]}
        # As transformers: PIL images and torch tensors (a hint on them means they are imported).
        if hint is getattr(sys.modules.get("PIL.Image"), "Image", None):
            return {"type": "image"}
        if hint is getattr(sys.modules.get("torch"), "Tensor", None):
            return {"type": "audio"}
        raise SchemaError(
            f"cannot turn the type hint {hint!r} into a JSON schema (a custom class?): use int, float, "
            "str, bool, an Enum, typing.Literal, or list, tuple, dict and Union of those"
        )
    if origin is typing.Union or origin is getattr(types, "UnionType", None):
        parts = [_hint_schema(a) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(p.keys() == {"type"} and isinstance(p["type"], str) for p in parts):
            kinds = sorted({p["type"] for p in parts})
            out = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            out = {"anyOf": parts}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        return _enum_schema(list(args))
    if origin is list:
        return {"type": "array", "items": _hint_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise SchemaError(f"the type hint {hint} is not supported: use list[...] instead")
        return {"type": "array", "prefixItems": [_hint_schema(a) for a in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _hint_schema(args[1])
        return out
    raise SchemaError(f"cannot turn the type hint {hint!r} into a JSON schema")


def _own_json_schema(fn):
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise SchemaError(f"Cannot generate JSON schema for {name} because it has no docstring!")
    doc = doc.strip()
    m = _DESCRIPTION.search(doc)
    description = m.group(1).strip() if m else None
    m = _ARGS_BLOCK.search(doc)
    arg_docs = {}
    if m:
        block = "\n".join(line for line in m.group(1).split("\n") if line.strip())
        arg_docs = {k: re.sub(r"\s*\n+\s*", " ", v.strip()) for _, k, v in _ONE_ARG.findall(block)}
    m = _RETURNS_BLOCK.search(doc)
    returns_doc = m.group(1).strip() if m else None

    hints = typing.get_type_hints(fn)
    params = inspect.signature(fn).parameters
    first = next(iter(params), None)
    receiver = first if first in ("self", "cls") and params[first].annotation is inspect.Parameter.empty else None
    required = []
    for p in params.values():
        if p.name == receiver:
            continue
        if p.annotation is inspect.Parameter.empty:
            raise SchemaError(f"Argument {p.name} is missing a type hint in function {name}")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    properties = {}
    for k, hint in hints.items():
        if k == receiver:
            continue
        try:
            properties[k] = _hint_schema(hint)
        except SchemaError:
            if k != "return":  # the model never writes the return value: left out
                raise
    returns = properties.pop("return", None)
    if returns is not None and returns_doc is not None:
        returns["description"] = returns_doc
    for arg, schema in properties.items():
        if arg not in arg_docs:
            raise SchemaError(
                f"Cannot generate JSON schema for {name} because the docstring has no description "
                f"for the argument '{arg}'"
            )
        desc = arg_docs[arg]
        choices = _CHOICES.search(desc)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            desc = desc[: choices.start()].strip()
        schema["description"] = desc
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        out["return"] = returns
    return {"type": "function", "function": out}


def _schema_function():
    try:
        from transformers.utils import get_json_schema

        return get_json_schema
    except Exception:  # not installed, or broken: our copy of its rules
        return _own_json_schema


# ---------------------------------------------------------------------------------------------
# Loading what the config names

_modules = {}


def _load(target, key):
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise StartError(key, f"`{target}`: expected path/to/file.py:name or module:name")
    cache_key = os.path.abspath(where) if where.endswith(".py") else where
    try:
        module = _modules.get(cache_key)
        if module is None:
            if where.endswith(".py"):
                path = cache_key
                if not os.path.isfile(path):
                    raise StartError(key, f"`{target}`: no file {path}")
                # As `python file.py` would: the file's directory is importable.
                if os.path.dirname(path) not in sys.path:
                    sys.path.append(os.path.dirname(path))
                stem = os.path.splitext(os.path.basename(path))[0]
                mod_name = f"_grpo_tools_{len(_modules)}_" + re.sub(r"\W", "_", stem)
                spec = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(where)
            _modules[cache_key] = module
    except StartError:
        raise
    except BaseException as e:  # SyntaxError, ImportError, SystemExit in the module, ...
        raise StartError(key, f"cannot load `{target}`: {_describe(e)}") from e
    obj = getattr(module, name, None)
    if obj is None:
        raise StartError(key, f"`{target}`: `{where}` has no attribute `{name}`")
    if not callable(obj):
        raise StartError(key, f"`{target}` is not callable")
    return obj


class Host:
    def __init__(self, spec):
        self.max_chars = int(spec.get("max_result_chars") or 4096)
        self.tools = {}  # name -> function
        self.targets = {}  # name -> target, for messages
        for target in spec.get("tools") or []:
            fn = _load(target, "tools")
            name = getattr(fn, "__name__", None) or target.rpartition(":")[2]
            if name in self.tools:
                raise StartError(
                    "tools", f"two tools are named `{name}`: `{self.targets[name]}` and `{target}`"
                )
            self.tools[name] = fn
            self.targets[name] = target
        self.factory = None
        self.env_methods = []
        self.env_has_reward = False
        self.pool = []  # instances free for a new episode
        self.episodes = {}  # episode -> instance
        env = spec.get("environment")
        self.reward_fns = []  # (target, function) of the reward functions taking `environments`
        if env:
            self._probe(env)
            for target in spec.get("reward_functions") or []:
                fn = _load(target, "reward_funcs")
                if _takes_environments(fn):
                    self.reward_fns.append((target, fn))
        self.loop = asyncio.new_event_loop()
        self.schemas = None
        if spec.get("check_schemas"):
            self.schemas = self.describe()

    def _probe(self, target):
        key = "environment_factory"
        self.factory = _load(target, key)
        try:
            instance = self.factory()
        except BaseException as e:
            raise StartError(key, f"`{target}()` raised {_describe(e)}") from e
        # As TRL: the class's functions, listed on the class (not the instance, whose properties
        # would run); `reset` must exist, `get_reward` is the reward, `_private` ones are skipped.
        names = [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)]
        if "reset" not in names:
            raise StartError(
                key,
                f"`{target}`: the environment class must define a `reset` method "
                "(called as reset(**row) at the start of each episode)",
            )
        self.env_has_reward = "get_reward" in names
        self.env_methods = [n for n in names if n not in ("reset", "get_reward") and not n.startswith("_")]
        for n in self.env_methods:
            if n in self.tools:
                raise StartError(
                    key, f"the tool `{self.targets[n]}` and the method `{n}` of `{target}` have the same name"
                )
        self.env_target = target
        self.pool.append(instance)

    def describe(self):
        if self.schemas is None:
            schema = _schema_function()
            tools, env_tools = [], []
            for name, fn in self.tools.items():
                tools.append(_schema_of(schema, fn, "tools", self.targets[name]))
            if self.pool or self.episodes:
                instance = (self.pool or list(self.episodes.values()))[0]
                for n in self.env_methods:
                    env_tools.append(_schema_of(schema, getattr(instance, n), "environment_factory", n))
            self.schemas = {"tools": tools, "env_tools": env_tools, "env_has_reward": self.env_has_reward,
                            "env_reward_functions": [t for t, _ in self.reward_fns]}
        return self.schemas

    # -- requests --------------------------------------------------------------------------

    def handle(self, req):
        op = req.get("op")
        if op == "describe":
            return dict(self.describe())
        if op == "call":
            fn = self.tools.get(req.get("tool"))
            if fn is None:
                return _error("unknown_tool", f"no tool named {req.get('tool')!r}")
            return self._run(fn, req.get("arguments"))
        episode = req.get("episode")
        if op == "reset":
            return self._reset(episode, req.get("row"))
        if op == "env_call":
            instance = self.episodes.get(episode)
            if instance is None:
                return _lost(episode)
            name = req.get("tool")
            if name not in self.env_methods:
                return _error("unknown_tool", f"the environment has no method {name!r}")
            return self._run(getattr(instance, name), req.get("arguments"))
        if op == "env_reward":
            out = self._reward(episode)
            out.update(self._reward_functions(episode, req.get("row"), req.get("messages")))
            return out
        if op == "close":
            instance = self.episodes.pop(episode, None)
            if instance is not None:
                self.pool.append(instance)
            return {"result": None}
        return _error("host", f"unknown op {op!r}")

    def _reset(self, episode, row):
        if self.factory is None:
            return _error("env_reset", "no environment_factory is configured")
        if not isinstance(row, dict):
            return _error("env_reset", "the row must be a JSON object")
        instance = self.episodes.pop(episode, None)
        try:
            if instance is None:
                instance = self.pool.pop() if self.pool else self.factory()
            reset = instance.reset
            try:
                inspect.signature(reset).bind(**row)
            except TypeError as e:
                self.pool.append(instance)
                return _error(
                    "env_reset",
                    f"reset(**row) does not accept the row's fields ({e}); "
                    "give reset a **kwargs parameter to take the ones it does not use",
                )
            except ValueError:
                pass  # no signature to check
            observation = self._await(reset(**row))
        except (Exception, SystemExit) as e:
            return _error("env_reset", _describe(e))
        if observation is not None and not isinstance(observation, str):
            return _error(
                "env_reset",
                f"reset returned a {type(observation).__name__}; it must return None or a string "
                "(added to the prompt)",
            )
        self.episodes[episode] = instance
        return {"result": observation}

    def _reward(self, episode):
        instance = self.episodes.get(episode)
        if not self.env_has_reward:
            return {"reward": None}
        if instance is None:
            return dict(_lost(episode), reward=None)
        try:
            value = self._await(instance.get_reward())
        except (Exception, SystemExit) as e:
            return dict(_error("raised", _describe(e)), reward=None)
        if value is None:
            return {"reward": None}
        if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
            value = float(value)
            return {"reward": value if math.isfinite(value) else None}
        return dict(_error("raised", f"get_reward returned {_short(repr(value))}, not a number"), reward=None)

    def _reward_functions(self, episode, row, messages):
        """The episode's scores from the reward functions that take `environments`."""
        if not self.reward_fns:
            return {"rewards": [], "errors": []}
        instance = self.episodes.get(episode)
        row = dict(row) if isinstance(row, dict) else {}
        kwargs = {k: [v] for k, v in row.items() if k != "prompt"}
        kwargs.update(prompts=[row.get("prompt")], completions=[messages], completion_ids=None)
        rewards, errors = [], []
        for target, fn in self.reward_fns:
            if instance is None:
                value, error = None, _lost(episode)["error"]
            else:
                value, error = _one_score(lambda: self._await(fn(environments=[instance], **kwargs)), target)
            rewards.append(value)
            errors.append(error)
        return {"rewards": rewards, "errors": errors}

    def _run(self, fn, arguments):
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return _error("arguments", "the arguments must be a JSON object")
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return _error("arguments", f"{getattr(fn, '__name__', 'tool')}: {e}")
        except ValueError:
            pass  # no signature to check (some builtins)
        try:
            value = self._await(fn(**arguments))
        except (Exception, SystemExit) as e:
            return _error("raised", _describe(e))
        return {"result": self._text(value)}

    def _await(self, value):
        if inspect.isawaitable(value):
            return self.loop.run_until_complete(value)
        return value

    def _text(self, value):
        if isinstance(value, str):
            text = value
        else:
            try:
                text = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError):
                text = str(value)
        if len(text) > self.max_chars:
            text = f"{text[: self.max_chars]}... [cut: {len(text) - self.max_chars} chars]"
        return text


def _takes_environments(fn):
    try:
        return "environments" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _one_score(call, target):
    """(value, None) or (None, error) of a reward function's call on one episode."""
    try:
        out = call()
    except (Exception, SystemExit) as e:
        return None, {"kind": "raised", "message": f"{target}: {_describe(e)}"}
    try:
        (value,) = list(out)
    except (TypeError, ValueError):
        return None, {"kind": "raised", "message": f"{target} returned {_short(repr(out))}, not a list of one score"}
    if value is None:
        return None, None
    if isinstance(value, numbers.Real):
        value = float(value)
        return (value if math.isfinite(value) else None), None
    return None, {"kind": "raised", "message": f"{target} returned the score {_short(repr(value))}, not a number"}


def _schema_of(schema, fn, key, what):
    try:
        return schema(fn)
    except Exception as e:
        raise StartError(key, f"`{what}`: no JSON schema: {_describe(e)}") from e


def _error(kind, message):
    return {"error": {"kind": kind, "message": message}}


def _lost(episode):
    return _error(
        "environment_lost",
        f"episode {episode} has no environment here (not reset, closed, or lost when its "
        "tool process was restarted)",
    )


def _short(s):
    return s if len(s) <= MAX_MESSAGE else f"{s[:MAX_MESSAGE]}... [cut: {len(s) - MAX_MESSAGE} chars]"


def _describe(e):
    """`ValueError: bad`, then the last frames of the traceback (the host's own left out)."""
    head = "".join(traceback.format_exception_only(type(e), e)).strip()
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != "<string>"]
    if frames:
        head += "\nTraceback (last calls):\n" + "".join(traceback.format_list(frames[-3:])).rstrip()
    return _short(head)


def main():
    # The protocol keeps its own copies of fd 0 and fd 1; what user code reads or prints goes
    # to /dev/null and stderr.
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)
    sys.stdout = sys.stderr

    def send(obj):
        answers.write(json.dumps(obj, ensure_ascii=False) + "\n")
        answers.flush()

    try:
        spec = json.loads(sys.argv[1] if len(sys.argv) > 1 else "")
        host = Host(spec)
    except StartError as e:
        print(f"grpo tool host: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    except Exception as e:
        print(f"grpo tool host: tools: {_describe(e)}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    send({"ready": True})
    for raw in requests:
        if not raw.strip():
            continue
        rid = None
        try:
            req = json.loads(raw)
            rid = req.get("id")
            out = host.handle(req)
        except Exception as e:  # a request grpo should not have sent
            out = _error("host", _describe(e))
        except SystemExit as e:  # a tool's thread or atexit hook; keep serving
            out = _error("raised", _describe(e))
        out["id"] = rid
        send(out)


if __name__ == "__main__":
    main()
