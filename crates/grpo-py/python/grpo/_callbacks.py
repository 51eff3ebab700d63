"""Callbacks as transformers' Trainer has them: TrainerState, TrainerControl, TrainerCallback.

A callback is any object with some of these methods (a `transformers.TrainerCallback` works as
it is); each is called as transformers calls it, `on_x(args, state, control, **kwargs)`:

- on_train_begin, on_train_end: once per `train()` call;
- on_step_end: after each optimizer step (state.global_step is the step's number);
- on_log: with `logs`, each logged row of metrics (the names metrics.jsonl has);
- on_evaluate: with `metrics`, after each evaluation on the held-out prompts;
- on_save: after each checkpoint (state.best_model_checkpoint, when the run keeps a best one).

Setting `control.should_training_stop = True` (or returning such a control) stops the run at
the end of the round, with a checkpoint.
"""

import dataclasses


@dataclasses.dataclass
class TrainerState:
    """The run's state as transformers' TrainerState names it (what reward functions get as
    `trainer_state`)."""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 1
    eval_steps: int = 0
    save_steps: int = 0
    train_batch_size: int = 0
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list = dataclasses.field(default_factory=list)
    best_metric: float = None
    best_global_step: int = None
    best_model_checkpoint: str = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str = None
    trial_params: dict = None
    stateful_callbacks: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TrainerControl:
    """What callbacks ask of the run; grpo reads `should_training_stop`."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class TrainerCallback:
    """A base class whose hooks do nothing (subclass it, or transformers' TrainerCallback)."""

    def on_train_begin(self, args, state, control, **kwargs):
        pass

    def on_train_end(self, args, state, control, **kwargs):
        pass

    def on_step_end(self, args, state, control, **kwargs):
        pass

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        pass

    def on_save(self, args, state, control, **kwargs):
        pass


class CallbackHandler:
    """Calls each callback's hook in order; a hook that returns a control replaces it."""

    def __init__(self, callbacks, args, state):
        self.callbacks = []
        for cb in callbacks or []:
            self.callbacks.append(cb() if isinstance(cb, type) else cb)
        self.args = args
        self.state = state
        self.control = TrainerControl()

    def call(self, event, **kwargs):
        for cb in self.callbacks:
            hook = getattr(cb, event, None)
            if hook is None:
                continue
            out = hook(self.args, self.state, self.control, **kwargs)
            if out is not None and hasattr(out, "should_training_stop"):
                self.control = out
        return self.control.should_training_stop
