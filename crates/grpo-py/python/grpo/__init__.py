"""grpo from Python: GRPO fine-tuning with TRL's API, run by grpo's Rust engine.

    from grpo import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        reward_funcs=my_reward,              # Python callables, TRL's built-in names, model ids
        args=GRPOConfig(output_dir="runs/mine", max_steps=100),
        train_dataset=dataset,               # datasets.Dataset, IterableDataset or a list of dicts
    )
    trainer.train()

`GRPOConfig` takes TRL's field names (the keys `grpo train` reads from a TRL YAML);
training, sampling, checkpoints and the config's own rewards run in the library as `grpo train`
runs them. See docs/python.md.
"""

from . import _grpo
from ._callbacks import TrainerCallback, TrainerControl, TrainerState
from ._config import GRPOConfig
from ._trainer import GRPOTrainer, TrainOutput

__version__ = _grpo.version()

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "TrainOutput",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "__version__",
]
