"""GRPOTrainer: TRL's GRPOTrainer arguments, converted and handed to grpo's engine."""

import collections
import inspect
import json
import os
import shutil
import signal
import sys
import threading
import warnings

from . import _grpo
from ._callbacks import CallbackHandler, TrainerControl, TrainerState
from ._config import GRPOConfig, to_json_value
from ._rewards import AsyncGroup, Caller, check_signature, reward_name

TrainOutput = collections.namedtuple("TrainOutput", ["global_step", "training_loss", "metrics"])

# Checkpoint files that are training state, not the model (`save_model` leaves them out).
TRAINING_STATE = {"optimizer.safetensors", "trainer_state.json", "config.toml"}


def dataset_rows(dataset, name):
    """A dataset as JSON rows: a `datasets.Dataset`, an `IterableDataset` (read to its end) or
    a list of dicts, standard (`prompt` a string) or conversational (a list of messages)."""
    if dataset is None:
        return None
    if hasattr(dataset, "keys") and not hasattr(dataset, "to_list") and not isinstance(
            dataset, (list, tuple)):
        raise TypeError(f"{name}: a dict of datasets (splits {list(dataset.keys())}): pass one "
                        f"split, e.g. dataset['train']")
    rows = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"{name}[{i}]: {type(row).__name__}, not a row (a dict of columns)")
    return json.dumps([to_json_value(r, f"{name}[{i}]") for i, r in enumerate(rows)])


def eval_names(metrics, prefix="eval"):
    """The engine's evaluation metrics (`eval/pass@1`, `eval/reward/x`) as transformers names
    them (`eval_pass@1`, `eval_reward_x`)."""
    out = {}
    for k, v in metrics.items():
        key = k.split("/", 1)[1] if k.startswith("eval/") else k
        out[f"{prefix}_{key}".replace("/", "_")] = v
    return out


def reward_table(name):
    """A string in `reward_funcs`: one of TRL's built-in rewards, else (as TRL reads it) a reward
    model's hub id or directory, scored as TRL scores it (its first logit of prompt + completion).
    Returns the table and whether it reads the `solution` column."""
    builtin = _grpo.builtin_reward_table(name)
    if builtin is not None:
        table, solution = builtin
        return json.loads(table), solution
    try:
        _grpo.resolve_model(name)
    except ValueError as e:
        raise ValueError(f"reward_funcs: `{name}` is neither one of TRL's rewards "
                         "(accuracy_reward, reasoning_accuracy_reward, think_format_reward, "
                         f"get_soft_overlong_punishment) nor a reward model ({e})") from None
    short = os.path.basename(os.path.normpath(name)) or name
    table = {"kind": "classifier", "name": short, "model": name, "input": "joined",
             "label": 0, "output": "logit"}
    return table, False


def python_target(obj, arg):
    """A tool function or an environment class as the config names it, `path/to/file.py:name`
    (a string is taken as it is). grpo runs tools in processes of their own, which load the
    file: the object must be defined at the top level of a file, and a script that defines it
    must start its work under `if __name__ == "__main__":` (else each tool process would run it)."""
    if isinstance(obj, (str, os.PathLike)):
        return os.fspath(obj)
    name = getattr(obj, "__name__", None)
    try:
        file = inspect.getsourcefile(obj)
    except TypeError:
        file = None
    if file is None or name is None or getattr(obj, "__qualname__", name) != name:
        raise TypeError(f"{arg}: {obj!r} is not a function or class defined at the top level of "
                        "a Python file; grpo runs it in a process of its own, which loads the file "
                        "(define it in a module, or pass 'path/to/file.py:name')")
    if getattr(obj, "__module__", None) == "__main__":
        with open(file) as f:
            guarded = "__name__" in f.read()
        if not guarded:
            raise ValueError(f"{arg}: {name} is defined in the script {file}, which grpo's tool "
                             "processes load: put the script's work under "
                             "`if __name__ == \"__main__\":`, or move the tool into a module")
    return f"{os.path.abspath(file)}:{name}"


def peft_fields(peft_config):
    """A `peft.LoraConfig` (or anything with its attributes) as the config's LoRA fields."""
    if peft_config is None:
        return {}
    fields = {"use_peft": True}
    for attr, key in (("r", "lora_r"), ("lora_alpha", "lora_alpha"),
                      ("lora_dropout", "lora_dropout"), ("target_modules", "lora_target_modules")):
        value = getattr(peft_config, attr, None)
        if value is not None:
            fields[key] = sorted(value) if isinstance(value, (set, frozenset)) else value
    # What grpo's adapters are not: the config refuses these keys with what to do instead.
    if getattr(peft_config, "use_dora", False):
        fields["use_dora"] = True
    if getattr(peft_config, "modules_to_save", None):
        fields["lora_modules_to_save"] = list(peft_config.modules_to_save)
    if getattr(peft_config, "use_rslora", False):
        raise ValueError("peft_config.use_rslora: grpo's LoRA scales by lora_alpha / r; "
                         "rank-stabilized scaling is not supported")
    return fields


class GRPOTrainer:
    """TRL's GRPOTrainer: `GRPOTrainer(model, reward_funcs, args=GRPOConfig(...),
    train_dataset=..., eval_dataset=..., peft_config=..., callbacks=[...])`.

    - `model`: a hub id or a local directory (or `.gguf` file); None: SmolLM2-135M-Instruct.
    - `reward_funcs`: one or a list of Python callables (called in this process as TRL calls
      them), names of TRL's built-in rewards (`accuracy_reward`, ...), reward models' hub ids or
      directories, or grpo `[[rewards]]` tables as dicts.
    - `train_dataset` / `eval_dataset`: `datasets.Dataset`, `IterableDataset` or a list of dicts.
    - `peft_config`: a `peft.LoraConfig` (its r, lora_alpha, lora_dropout, target_modules).
    - `callbacks`: TrainerCallback-style objects (see grpo._callbacks for the hooks called).
    - `processing_class`, `reward_processing_classes`: grpo uses each model's own tokenizer.

    Everything is checked here, before any training: an unknown config field, a dataset without
    its prompt column, a reward function that cannot take TRL's keyword arguments, a model that
    does not exist.
    """

    def __init__(self, model=None, reward_funcs=None, args=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None,
                 callbacks=None, optimizers=(None, None), peft_config=None, tools=None,
                 environment_factory=None, **kwargs):
        if kwargs:
            raise TypeError(f"GRPOTrainer got unexpected arguments {sorted(kwargs)}")
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model: grpo loads the model itself: pass its hub id or path, not a "
                            f"{type(model).__name__}")
        for arg, value in (("processing_class", processing_class),
                           ("reward_processing_classes", reward_processing_classes)):
            if value is not None:
                warnings.warn(f"GRPOTrainer: {arg} is ignored: grpo uses each model's own "
                              "tokenizer and chat template", stacklevel=2)
        if optimizers != (None, None):
            raise ValueError("optimizers: grpo's optimizer is AdamW as the config sets it "
                             "(learning_rate, adam_beta1, weight_decay, lr_scheduler_type, ...)")
        if reward_funcs is None:
            raise TypeError("GRPOTrainer needs reward_funcs")
        model = os.fspath(model) if model is not None else None
        if args is None:
            base = os.path.basename(os.path.normpath(model)) if model else "SmolLM2-135M-Instruct"
            args = GRPOConfig(output_dir=f"{base}-GRPO")
        self.args = args
        fields = dict(args.fields)
        if model is not None:
            fields["model"] = model
        fields.update(peft_fields(peft_config))
        # Agents (TRL's tools= and environment_factory=): they run in processes of their own, as
        # `grpo train` runs them, with this interpreter (and its packages) unless GRPO_PYTHON says.
        os.environ.setdefault("GRPO_PYTHON", sys.executable)
        if tools is not None:
            fields["tools"] = [python_target(t, "tools") for t in tools]
        if environment_factory is not None:
            fields["environment_factory"] = python_target(environment_factory,
                                                          "environment_factory")
        self.state = TrainerState()
        self._pending_metrics = collections.defaultdict(list)
        self.extra_columns = {}
        self._callbacks = CallbackHandler(callbacks, args, self.state)
        self._rewards, tables, host = self._reward_setup(reward_funcs, fields, args)
        fields["rewards"] = tables + list(fields.get("rewards", []))
        self._fields = {k: to_json_value(v, f"GRPOConfig.{k}") for k, v in fields.items()}
        self._train = dataset_rows(train_dataset, "train_dataset")
        self._eval = dataset_rows(eval_dataset, "eval_dataset")
        self._host = host
        self._native = self._make_native(self._eval)
        self.model_path = _grpo.resolve_model(self._fields.get("model"))
        self.state.logging_steps = args.logging_steps
        self.state.eval_steps = args.eval_steps
        self.state.save_steps = args.save_steps
        self.state.train_batch_size = args.per_device_train_batch_size

    def _reward_setup(self, reward_funcs, fields, args):
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        group = AsyncGroup()
        tables, host, callers, names = [], [], [], set()
        on_error = args.reward_errors or "raise"
        for i, f in enumerate(funcs):
            if isinstance(f, (str, os.PathLike)):
                table, solution = reward_table(os.fspath(f))
                if solution and "answer_field" not in fields:
                    fields["answer_field"] = "solution"
                tables.append(table)
                name = table["name"]
            elif isinstance(f, dict):
                tables.append(dict(f))
                name = f.get("name", f.get("kind"))
            elif callable(f):
                name = reward_name(f)
                check_signature(f, name)
                caller = Caller(f, name, self, group, on_error)
                callers.append(caller)
                host.append((i, name, 1.0, caller))
            else:
                raise TypeError(f"reward_funcs[{i}]: {type(f).__name__}: give a function, a "
                                "reward model's id or path, or a TRL reward's name")
            if name in names:
                raise ValueError(f"reward_funcs[{i}]: two rewards are named '{name}'; rename "
                                 "one (metrics use the names)")
            names.add(name)
        return callers, tables, host

    def _make_native(self, eval_rows):
        return _grpo.Trainer(json.dumps(self._fields), self._train, eval_rows, self._host)

    # TRL's hooks for reward functions: `log_metric(name, value)` (averaged into the next logged
    # row) and `log_extra(column, values)` (kept in `trainer.extra_columns`).
    def _log_metric(self, name, value):
        self._pending_metrics[name].append(float(value))

    def _log_extra(self, column, values):
        self.extra_columns[column] = list(values)

    @property
    def reward_func_names(self):
        return [c.name for c in self._rewards]

    def train(self, resume_from_checkpoint=None, **kwargs):
        """Trains (`resume_from_checkpoint=True`, or the newest checkpoint's path: continue the
        run in output_dir). Ctrl-C (or SIGTERM) stops at the end of the current step with a
        checkpoint; `trainer.train(resume_from_checkpoint=True)` continues it."""
        resume = self._resume_flag(resume_from_checkpoint)
        self._callbacks.control = TrainerControl()
        first_row = len(self.state.log_history)
        observer = _Observer(self)
        result = {}

        done = threading.Event()

        def run():
            try:
                result["out"] = self._native.train(resume, observer)
            except BaseException as e:  # re-raised in the caller's thread
                result["err"] = e
            finally:
                done.set()

        # The engine runs on a thread of its own, so that this one takes Ctrl-C (a notebook's
        # interrupt) and asks the run to stop at the end of its step.
        worker = threading.Thread(target=run, name="grpo-train", daemon=True)
        restore = self._catch_sigterm()
        worker.start()
        try:
            self._wait(done)
        finally:
            restore()
            observer.close()
        if "err" in result:
            raise result["err"]
        out = json.loads(result["out"])
        self.state.global_step = out["steps"]
        self._callbacks.call("on_train_end")
        losses = [h["loss"] for h in self.state.log_history[first_row:]
                  if h.get("loss") is not None]
        metrics = {"train_loss": sum(losses) / len(losses) if losses else float("nan"),
                   "interrupted": out["interrupted"]}
        if out.get("last_eval"):
            metrics.update({k.replace("/", "_"): v for k, v in out["last_eval"].items()})
        self.last_checkpoint = out["last_checkpoint"]
        if out["best_checkpoint"]:
            self.state.best_model_checkpoint = out["best_checkpoint"]
        return TrainOutput(out["steps"], metrics["train_loss"], metrics)

    def _wait(self, done):
        # An Event, not Thread.join: a join that Ctrl-C interrupts can report a live thread as
        # finished (CPython's gh-90882).
        try:
            while not done.wait(0.2):
                pass
        except KeyboardInterrupt:
            self._native.request_stop()
            print("\nstop requested: finishing the current step, then saving a checkpoint "
                  "(interrupt again to stop waiting; the step still finishes)", file=sys.stderr)
            while not done.wait(0.2):
                pass

    def _catch_sigterm(self):
        """SIGTERM (Slurm's preemption) stops at the next step boundary with a checkpoint, as it
        does `grpo train`; the previous handler is restored after."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda *_: self._native.request_stop())
        return lambda: signal.signal(signal.SIGTERM, previous)

    def _resume_flag(self, resume_from_checkpoint):
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return False
        if resume_from_checkpoint is True:
            return True
        path = os.path.abspath(os.fspath(resume_from_checkpoint))
        newest = self._newest_checkpoint()
        if newest is None or os.path.abspath(newest) != path:
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: grpo resumes "
                             f"from the newest checkpoint in output_dir ({newest}); pass True")
        return True

    def _newest_checkpoint(self):
        out = self._native.output_dir
        if not os.path.isdir(out):
            return None
        steps = [(int(d.split("-")[1]), d) for d in os.listdir(out)
                 if d.startswith("checkpoint-") and d.split("-")[1].isdigit()]
        return os.path.join(out, max(steps)[1]) if steps else None

    def save_model(self, output_dir=None):
        """Writes the trained model (a full fine-tune's weights, or a LoRA run's adapter), its
        config and tokenizer into `output_dir` (default args.output_dir): the last checkpoint's
        files without the optimizer state."""
        source = getattr(self, "last_checkpoint", None) or self._newest_checkpoint()
        if source is None:
            raise RuntimeError("save_model: no checkpoint to save from: train first (with "
                               "save_strategy = \"no\" no checkpoint is written)")
        output_dir = os.fspath(output_dir or self.args.output_dir)
        os.makedirs(output_dir, exist_ok=True)
        for name in os.listdir(source):
            src = os.path.join(source, name)
            if name not in TRAINING_STATE and os.path.isfile(src):
                shutil.copy2(src, os.path.join(output_dir, name))
        self._callbacks.call("on_save")
        return output_dir

    def evaluate(self, eval_dataset=None, metric_key_prefix="eval"):
        """Evaluation on the held-out prompts (eval_dataset, else the trainer's, else the config's)
        of the trained model (the last checkpoint; before training, the model): pass@k, accuracy
        and mean rewards as training's evaluation computes them, named `eval_accuracy`,
        `eval_pass@1`, ..."""
        native = self._native
        if eval_dataset is not None:
            native = self._make_native(dataset_rows(eval_dataset, "eval_dataset"))
        model = getattr(self, "last_checkpoint", None)
        metrics = eval_names(json.loads(native.evaluate(model)), metric_key_prefix)
        metrics["step"] = self.state.global_step
        self.state.log_history.append(dict(metrics))
        self._callbacks.call("on_evaluate", metrics=metrics)
        return metrics


class _Observer:
    """The engine's hooks (`grpo::train::Observer`): trainer.state, the user's callbacks, a
    progress bar in notebooks. A true return stops the run at the end of the round."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.bar = None

    @property
    def callbacks(self):
        return self.trainer._callbacks

    def on_train_begin(self, total_steps, step):
        state = self.trainer.state
        state.max_steps, state.global_step = total_steps, step
        self.bar = progress_bar(self.trainer.args, total_steps, step)
        return self.callbacks.call("on_train_begin")

    def on_step_end(self, step):
        self.trainer.state.global_step = step
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        return self.callbacks.call("on_step_end")

    def on_log(self, step, metrics):
        logs = dict(metrics)
        pending = self.trainer._pending_metrics
        for name, values in pending.items():
            logs[name] = sum(values) / len(values)
        pending.clear()
        state = self.trainer.state
        if "epoch" in logs:
            state.epoch = logs["epoch"]
        logs["step"] = step
        state.log_history.append(logs)
        return self.callbacks.call("on_log", logs=logs)

    def on_evaluate(self, step, metrics):
        return self.callbacks.call("on_evaluate", metrics=eval_names(dict(metrics)))

    def on_save(self, step, directory):
        self.trainer.last_checkpoint = directory
        return self.callbacks.call("on_save")

    def close(self):
        if self.bar is not None:
            self.bar.close()


def progress_bar(args, total, start):
    """In a notebook (stderr is not a terminal), a tqdm bar of optimizer steps; on a terminal
    the engine draws its own."""
    if args.disable_tqdm or sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, desc="grpo", unit="step")
