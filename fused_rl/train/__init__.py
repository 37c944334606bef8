"""A thin GRPO / PPO trainer on Hugging Face transformers whose loss is :func:`fused_rl.linear_policy_loss`.

``fused-rl train`` (the console script, :mod:`fused_rl.train.cli`) runs the embedded default: a tiny
transformer learning to repeat digit strings from scratch on a CPU. See docs/train.md.
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
    """Load a config (path / bundled name / None for the default), apply overrides, train; returns history.
    A :class:`TrainConfig` is validated and trained as it is (overrides or keywords with it raise)."""
    from .trainer import Trainer, close_distributed

    if isinstance(config, TrainConfig):
        if overrides or kwargs:
            raise ConfigError("train(): overrides or keyword options with a TrainConfig would be ignored; set its "
                              "fields instead (or pass a config file / bundled name)")
        cfg = config
    else:
        cfg = load_config(config, overrides, **kwargs)
    history = Trainer(cfg).train()
    close_distributed()
    return history
