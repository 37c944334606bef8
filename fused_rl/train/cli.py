"""The ``fused-rl`` console script.

* ``fused-rl train [--config FILE.yaml | NAME] [--key value ...]``: train (no arguments: the embedded default);
* ``fused-rl eval RUN_DIR [--prompts N] [--device D]``: greedy reward of the checkpointed policy on held-out prompts;
* ``fused-rl plot RUN_DIR [--out FILE.png]``: the reward / KL / entropy / length curves;
* ``fused-rl info``: versions and available backends.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def _train(argv: list[str]) -> int:
    from .config import ConfigError, bundled_names, load_config
    from .trainer import Trainer, close_distributed

    config = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in ("-c", "--config"):
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"--config needs a file (bundled configs, by name: {bundled_names()})")
            config = argv[i + 1]
            i += 2
        elif argv[i].startswith("--config="):
            config = argv[i].split("=", 1)[1]
            i += 1
        elif argv[i] in ("-h", "--help"):
            from .config import field_names

            print("usage: fused-rl train [--config FILE.yaml|default|smollm2] [--key value ...]\n"
                  "options (see docs/train.md): " + ", ".join(field_names()))
            return 0
        else:
            rest.append(argv[i])
            i += 1
    cfg = load_config(config, rest)
    Trainer(cfg).train()
    close_distributed()
    return 0


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fused-rl eval", description="greedy held-out reward of a run's checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--prompts", type=_positive_int, default=None,
                   help="held-out prompts to evaluate (default: the run's eval_prompts)")
    p.add_argument("--device", default=None, help="device to evaluate on (default: the run's, e.g. cpu for a run "
                                                  "trained on cuda)")
    args = p.parse_args(argv)
    from . import checkpoint
    from .config import from_dict
    from .trainer import Trainer

    state = checkpoint.load_state(args.run_dir)
    saved = {**state["config"], "resume": False, "run_dir": args.run_dir}
    if args.device is not None:
        saved["device"] = args.device
    if saved.get("model", "tiny") != "tiny":  # an older run's model_config (a default file's tiny sizes) went unused
        saved["model_config"] = {}
    cfg = from_dict(saved).validate()
    trainer = Trainer(cfg, quiet=True)
    trainer.policy.load_state_dict(state["model"])
    result = trainer.evaluate(args.prompts)
    asked = cfg.eval_prompts if args.prompts is None else args.prompts
    used = len(trainer.task.heldout(asked))  # at most the task's held-out prompts, each once
    print(f"step {state['step']}: eval_reward={result['eval_reward']:.4f} eval_accuracy={result['eval_accuracy']:.4f} "
          f"on {used} held-out prompts" + (f" (of {asked} asked: the task has no more)" if used < asked else ""))
    for prompt, completion in result["samples"]:
        print(f"  {prompt!r} -> {completion!r}")
    return 0


def _plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fused-rl plot", description="plot RUN_DIR/metrics.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from .plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _info(argv: list[str]) -> int:
    if argv:
        print(f"fused-rl info: takes no arguments, got {argv}", file=sys.stderr)
        return 2
    from ..info import main as info_main

    info_main()
    return 0


COMMANDS = {"train": _train, "eval": _eval, "plot": _plot, "info": _info}
#: Top-level modules of the extras the commands import when they run -> the extra to install.
EXTRA_OF_MODULE = {"yaml": "train", "transformers": "train", "tqdm": "train", "matplotlib": "train",
                   "gguf": "smollm2", "accelerate": "smollm2"}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # no command: the usage, not a 150-step job writing runs/default
        print(__doc__)
        return 2
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd = argv[0]
    if cmd not in COMMANDS:
        if cmd.startswith("-"):  # `fused-rl --steps 10` means train
            cmd, argv = "train", ["train", *argv]
        else:
            print(f"fused-rl: unknown command {cmd!r}; choose one of {sorted(COMMANDS)}", file=sys.stderr)
            return 2
    from .config import ConfigError
    from .plot import MetricsError
    from .tasks import RewardFunctionError

    try:
        return COMMANDS[cmd](argv[1:])
    except (ConfigError, RewardFunctionError, MetricsError, FileNotFoundError, FloatingPointError) as exc:
        print(f"fused-rl {cmd}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # `pip install fused_rl` without the extra the command needs
        extra = EXTRA_OF_MODULE.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"fused-rl {cmd}: error: needs {exc.name!r}, from the [{extra}] extra: "
              f"pip install 'fused_rl[{extra}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
