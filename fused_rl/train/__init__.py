"""A thin GRPO / PPO trainer on Hugging Face transformers whose loss is :func:`fused_rl.linear_policy_loss`.

``fused-rl train`` (the console script, :mod:`fused_rl.train.cli`) runs the embedded default: a tiny
transformer learning to reverse digit strings from scratch on a CPU. See docs/train.md.
"""

from .config import ConfigError, TrainConfig, load_config
from .tasks import RewardFunctionError

__all__ = ["TrainConfig", "ConfigError", "RewardFunctionError", "load_config", "Trainer", "train"]


def __getattr__(name):
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(name)


def train(config=None, overrides=None, **kwargs):
    """Load a config (path / bundled name / None for the default), apply overrides, train; returns history."""
    from .trainer import Trainer

    cfg = config if isinstance(config, TrainConfig) else load_config(config, overrides, **kwargs)
    return Trainer(cfg).train()
