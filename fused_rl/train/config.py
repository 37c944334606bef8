"""Trainer configuration: one flat dataclass, loaded from YAML and overridden by ``--key value`` flags.

Every field is validated in :meth:`TrainConfig.validate`; a bad value raises :class:`ConfigError`
naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Union

from ..config import KL_ESTIMATORS as LOSS_KL_ESTIMATORS

ALGORITHMS = ("grpo", "dr_grpo", "dapo", "rloo", "ppo")
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "gae")
TRUNCATION = ("mask", "penalize", "none")
SCHEDULES = ("cosine", "constant")
DTYPES = ("float32", "bfloat16")
#: the loss's estimators (``k3+`` and the other straight-through forms included)
KL_ESTIMATORS = tuple(k for k in LOSS_KL_ESTIMATORS if k is not None)
#: the largest finite float32: rewards are kept in float32
FLOAT32_MAX = 3.4028234663852886e38
#: torch.manual_seed's range (seeds derived from ``seed`` wrap around it)
SEED_LIMIT = 2 ** 64

#: algorithm -> (PolicyLossConfig preset, advantage estimator)
ALGORITHM_DEFAULTS = {
    "grpo": ("grpo", "grpo"),
    "dr_grpo": ("dr_grpo", "dr_grpo"),
    "dapo": ("dapo", "grpo"),
    "rloo": ("bnpo", "rloo"),
    "ppo": ("ppo", "gae"),
}


#: PolicyLossConfig fields that ``loss_options`` may not set, and where they come from.
LOSS_OPTIONS_OWNED = {
    "temperature": "the sampling temperature: set 'temperature'",
    "max_len": "dr_grpo's max_new_tokens",
    # fields of their own, which the trainer's checks read (beta > 0 builds the reference model)
    **{name: f"set the top-level {name!r}" for name in ("beta", "kl", "entropy_coef", "clip_low", "clip_high")},
}


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


#: A float without a dot or without an exponent sign (``1e-3``, ``1e5``, ``2.5e3``), which YAML 1.2 reads as a
#: number and YAML 1.1's resolver (PyYAML's) as a string.
_YAML_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


@functools.lru_cache(maxsize=None)
def _yaml_classes():
    """PyYAML's SafeLoader and SafeDumper with :data:`_YAML_FLOAT` resolved as a float at every depth: the loader
    reads ``1e-3`` as a number, the dumper quotes a string such as ``"3e-3"`` so that it reads back a string. The
    loader refuses a key given twice in one mapping."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            """A mapping whose node lists a scalar key twice raises: PyYAML would keep the last value silently.
            ``<<`` merge keys are left out, so a key set here over a merged one is an override, not a duplicate."""
            first_line: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (line {first_line[key]}, again on line {line}): a key "
                                    "may be given once per mapping")
                first_line[key] = line
            return super().construct_mapping(node, deep=deep)

    class Dumper(yaml.SafeDumper):
        pass

    for cls in (Loader, Dumper):
        cls.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_FLOAT, list("-+0123456789"))
    return Loader, Dumper


def yaml_load(text: str) -> Any:
    """``text`` parsed as YAML with :func:`_yaml_classes`' loader."""
    import yaml

    return yaml.load(text, Loader=_yaml_classes()[0])


def yaml_dump(data: Any) -> str:
    """``data`` as YAML that :func:`yaml_load` reads back the same (keys in order)."""
    import yaml

    return yaml.dump(data, Dumper=_yaml_classes()[1], sort_keys=False)


@dataclass
class TrainConfig:
    """All trainer options (see docs/train.md for each)."""

    # run
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 150
    device: str = "auto"
    dtype: str = "float32"
    threads: int = 0  # torch.set_num_threads; 0 = leave torch's default
    # task and rewards
    task: str = "copy"
    task_args: dict = field(default_factory=dict)
    rewards: list = field(default_factory=list)  # [] = the task's default; names or "module:function"
    reward_weights: list = field(default_factory=list)
    # model
    model: str = "tiny"  # "tiny" | a local directory | a .gguf file
    model_config: dict = field(default_factory=dict)  # tiny model sizes
    tokenizer: str = "auto"  # "auto": char tokenizer for tiny, else the model's
    chat_template: bool = False
    attn_implementation: str = "auto"
    # rollout
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    truncation: str = "none"
    truncation_penalty: float = 0.0
    # optimisation
    algorithm: str = "grpo"
    loss_preset: Optional[str] = None  # None: from algorithm
    advantage: Optional[str] = None  # None: from algorithm
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None
    beta: float = 0.0
    kl: str = "k3"
    entropy_coef: float = 0.0
    loss_options: dict = field(default_factory=dict)  # more PolicyLossConfig fields, e.g. {policy_loss: sapo}
    kimi_length_coef: float = 0.0
    kimi_length_warmup_steps: int = 0  # the first N steps train on the plain reward (Kimi k1.5 warms up so)
    correct_threshold: float = 1.0
    # the reward (as listed in rewards, or a task default's name) whose own value >= correct_threshold makes a
    # completion correct, for the accuracy metrics and the Kimi length reward; "" = the weighted total
    correct_reward: str = ""
    num_iterations: int = 1
    minibatch_size: int = 0  # sequences per optimizer step; 0 = the whole rollout batch
    micro_batch_size: int = 0  # sequences per forward/backward, at most (a preset's bound holds for a smaller
    # minibatch: clamped to it); 0 = minibatch_size
    lr: float = 3e-3
    weight_decay: float = 0.0
    adam_betas: list = field(default_factory=lambda: [0.9, 0.99])
    warmup_steps: int = 10
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    backend: str = "auto"
    # PPO
    vf_coef: float = 0.5
    value_clip: Optional[float] = 0.2  # max move of V from the rollout's values (TRL's cliprange_value); null: off
    gamma: float = 1.0
    lam: float = 0.95
    # logging / eval / checkpoints
    log_every: int = 1
    eval_every: int = 0
    eval_prompts: int = 64
    save_every: int = 0
    resume: bool = False
    plot: bool = True
    progress: bool = True

    # ------------------------------------------------------------------ derived
    @property
    def resolved_loss_preset(self) -> str:
        return self.loss_preset or ALGORITHM_DEFAULTS[self.algorithm][0]

    @property
    def resolved_advantage(self) -> str:
        return self.advantage or ALGORITHM_DEFAULTS[self.algorithm][1]

    @property
    def rollout_size(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def resolved_minibatch(self) -> int:
        return self.minibatch_size or self.rollout_size

    @property
    def resolved_micro(self) -> int:
        return min(self.micro_batch_size or self.resolved_minibatch, self.resolved_minibatch)

    def loss_config(self):
        from fused_rl import PolicyLossConfig

        overrides: dict[str, Any] = {"temperature": self.temperature, "entropy_coef": self.entropy_coef}
        if self.clip_low is not None:
            overrides["clip_low"] = self.clip_low
        if self.clip_high is not None:
            overrides["clip_high"] = self.clip_high
        if self.beta > 0:
            overrides.update(beta=self.beta, kl=self.kl)
        if self.resolved_loss_preset == "dr_grpo":
            overrides["max_len"] = self.max_new_tokens
        overrides.update(self.loss_options)
        try:
            return PolicyLossConfig.preset(self.resolved_loss_preset, **overrides)
        except ValueError as exc:
            raise ConfigError(f"invalid loss settings: {exc}") from exc

    # ------------------------------------------------------------------ validation
    def validate(self) -> "TrainConfig":
        def fail(name: str, msg: str) -> None:
            raise ConfigError(f"config field {name!r} = {getattr(self, name)!r}: {msg}")

        def check_int(name: str, low: int) -> None:
            v = getattr(self, name)
            if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53:
                fail(name, f"must be an integer: write {int(v)} (YAML and the command line read a number with a "
                           "dot or an exponent, such as 1e3, as a float)")
            if isinstance(v, bool) or not isinstance(v, int):
                fail(name, "must be an integer")
            if v < low:
                fail(name, f"must be >= {low}")

        def check_float(name: str, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                fail(name, "must be a finite number")
            if v < low or v > high or (low_open and v == low):
                fail(name, f"must be in {'(' if low_open else '['}{low}, {high}]")
            setattr(self, name, float(v))

        def check_choice(name: str, choices: tuple) -> None:
            if getattr(self, name) not in choices:
                fail(name, f"must be one of {list(choices)}")

        for name in ("seed", "threads", "eval_every", "save_every", "minibatch_size", "micro_batch_size",
                     "warmup_steps", "kimi_length_warmup_steps"):
            check_int(name, 0)
        for name in ("steps", "prompts_per_step", "max_new_tokens", "num_iterations", "log_every",
                     "eval_prompts"):
            check_int(name, 1)
        check_int("group_size", 1)
        if self.seed >= SEED_LIMIT:
            fail("seed", "must be in [0, 2**64 - 1] (torch's seeds)")
        from fused_rl.config import MIN_TEMPERATURE

        check_float("temperature", MIN_TEMPERATURE)  # below it samplers decode greedily
        check_float("top_p", 0.0, 1.0, low_open=True)
        check_float("lr", 0.0, low_open=True)
        check_float("weight_decay", 0.0)
        check_float("min_lr_ratio", 0.0, 1.0)
        check_float("max_grad_norm", 0.0)
        check_float("beta", 0.0)
        check_float("entropy_coef")
        check_float("kimi_length_coef", 0.0, FLOAT32_MAX)  # rewards are float32
        check_float("truncation_penalty")
        check_float("correct_threshold")
        check_float("vf_coef", 0.0)
        check_float("gamma", 0.0, 1.0)
        check_float("lam", 0.0, 1.0)
        for name in ("clip_low", "clip_high"):
            if getattr(self, name) is not None:
                check_float(name, 0.0)
        if self.value_clip is not None:
            check_float("value_clip", 0.0, low_open=True)
        check_choice("algorithm", ALGORITHMS)
        check_choice("truncation", TRUNCATION)
        check_choice("lr_schedule", SCHEDULES)
        if self.dtype == "float16":
            fail("dtype", "float16 weights need fp32 master weights and loss scaling, which this trainer does "
                          "not do (AdamW's first step turns them into NaN); use float32 or bfloat16")
        check_choice("dtype", DTYPES)
        for name in ("chat_template", "resume", "plot", "progress"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be true or false")
        check_choice("kl", KL_ESTIMATORS)
        if self.advantage is not None:
            check_choice("advantage", ADVANTAGES)
        from fused_rl import PRESETS
        from fused_rl.backends import BACKEND_NAMES

        if self.loss_preset is not None:
            check_choice("loss_preset", tuple(PRESETS))
        check_choice("backend", BACKEND_NAMES)
        for name in ("run_dir", "device", "task", "model", "tokenizer", "attn_implementation"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                fail(name, "must be a non-empty string")
        if not isinstance(self.correct_reward, str):
            fail("correct_reward", "must be a reward's name, as listed in rewards ('' = the weighted total)")
        if self.device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:[0-9]+)?", self.device):
            fail("device", "must be 'auto', 'cpu' or 'cuda[:N]'")
        if not isinstance(self.task_args, dict):
            fail("task_args", "must be a mapping")
        if not isinstance(self.model_config, dict):
            fail("model_config", "must be a mapping")
        if self.model_config and self.model != "tiny":
            fail("model_config", f"sizes the randomly initialised model 'tiny' only; config field 'model' = "
                                 f"{self.model!r} is loaded with its own config (drop model_config, or use "
                                 "model: tiny)")
        if not isinstance(self.loss_options, dict):
            fail("loss_options", "must be a mapping of PolicyLossConfig fields")
        for name in self.loss_options:
            if not isinstance(name, str):  # YAML reads {1: 2} or {null: 2}; PolicyLossConfig.preset raised TypeError
                fail("loss_options", f"keys are PolicyLossConfig field names, got {name!r}")
        for name in LOSS_OPTIONS_OWNED:
            if name in self.loss_options:
                fail("loss_options", f"{name!r} is set by the trainer ({LOSS_OPTIONS_OWNED[name]})")
        dr_grpo_agg = "seq-mean-token-sum-norm"
        if self.resolved_loss_preset == "dr_grpo" and self.loss_options.get("agg", dr_grpo_agg) != dr_grpo_agg:
            fail("loss_options", f"loss preset 'dr_grpo' fixes agg = {dr_grpo_agg!r} (divided by max_new_tokens); "
                                 "for another aggregation choose another loss_preset (e.g. bnpo: token-mean) with "
                                 "advantage: dr_grpo")
        if isinstance(self.rewards, str):
            self.rewards = [self.rewards]
        if not isinstance(self.rewards, list) or not all(isinstance(r, str) for r in self.rewards):
            fail("rewards", "must be a list of reward names or 'module:function' strings")
        if not isinstance(self.reward_weights, list) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                for w in self.reward_weights):
            fail("reward_weights", "must be a list of finite numbers, one per reward")
        if self.reward_weights:
            if not self.rewards:
                fail("reward_weights", "needs the rewards listed (rewards: [...]), one weight per reward")
            if len(self.reward_weights) != len(self.rewards):
                fail("reward_weights", f"needs one weight per reward ({len(self.rewards)} rewards)")
        if (not isinstance(self.adam_betas, (list, tuple)) or len(self.adam_betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                           for b in self.adam_betas)):
            fail("adam_betas", "must be two numbers in [0, 1)")
        if self.resolved_advantage in ("grpo", "dr_grpo", "rloo") and self.group_size < 2:
            fail("group_size", f"advantage {self.resolved_advantage!r} compares samples of one prompt: needs >= 2")
        if self.kimi_length_coef > 0 and self.group_size < 2:
            fail("kimi_length_coef", f"the Kimi length reward compares the lengths of one prompt's samples: needs "
                                     f"group_size >= 2 (group_size = {self.group_size})")
        self._resolve_paths()
        twice = sorted({r for r in self.rewards if self.rewards.count(r) > 1})
        if twice:
            fail("rewards", f"lists {', '.join(map(repr, twice))} twice (a reward's values are logged and read by "
                            "correct_reward under its name): weight it with reward_weights instead")
        if self.resolved_minibatch > self.rollout_size or self.rollout_size % self.resolved_minibatch:
            fail("minibatch_size", f"must divide the rollout batch prompts_per_step * group_size = {self.rollout_size}")
        if self.resolved_minibatch % self.resolved_micro:
            fail("micro_batch_size", f"must divide minibatch_size = {self.resolved_minibatch}")
        if self.warmup_steps >= self.steps and self.warmup_steps > 0:
            fail("warmup_steps", f"must be smaller than steps = {self.steps} (warmup_steps: 0 for none)")
        if self.kimi_length_coef > 0 and self.kimi_length_warmup_steps >= self.steps:
            fail("kimi_length_warmup_steps", f"must be smaller than steps = {self.steps}: the length reward would "
                                             "never apply")
        self.loss_config()  # validates the loss fields together
        self._reject_unused()
        return self

    def _resolve_paths(self) -> None:
        """Relative paths of existing files (a reward's ``file.py``, a jsonl task's ``path``, a model directory or
        .gguf file, a tokenizer directory) become absolute, resolved against the working directory: the run's saved
        config then works from anywhere (``fused-rl eval RUN_DIR``). A name that is no file here (a Hugging Face
        hub id in the local cache, a missing file that loading will report) is kept as it is."""
        def absolute(path: str) -> str:
            return str(Path(path).resolve()) if Path(path).exists() else path

        def reward(spec: str) -> str:  # "file.py:fn" with the file's absolute path
            parts = spec.rsplit(":", 1)
            return f"{absolute(parts[0])}:{parts[1]}" if len(parts) == 2 and parts[0].endswith(".py") else spec

        self.rewards = [reward(spec) for spec in self.rewards]
        self.correct_reward = reward(self.correct_reward)  # spelled as in rewards
        if self.task == "jsonl" and isinstance(self.task_args.get("path"), str):
            self.task_args = {**self.task_args, "path": absolute(self.task_args["path"])}
        if self.model != "tiny" and not self.model.startswith("package:"):
            self.model = absolute(self.model)
        if self.tokenizer != "auto":
            self.tokenizer = absolute(self.tokenizer)

    def _reject_unused(self) -> None:
        """An option changed from its default where nothing reads it is a mistake, not a no-op."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING}
        unused = {name: "is only used by advantage 'gae' (algorithm ppo)"
                  for name in ("vf_coef", "value_clip", "gamma", "lam") if self.resolved_advantage != "gae"}
        if self.truncation != "penalize":
            unused["truncation_penalty"] = "is only used with truncation: penalize"
        if self.kimi_length_coef == 0.0:
            unused["kimi_length_warmup_steps"] = "is only used with kimi_length_coef > 0"
        if self.beta == 0.0:
            unused["kl"] = "is only used with beta > 0"
        if self.lr_schedule == "constant":
            unused["min_lr_ratio"] = "is only used by lr_schedule cosine"
        if self.model == "tiny":
            unused.update({name: "is not used by model 'tiny' (character tokenizer, eager attention)"
                           for name in ("tokenizer", "chat_template", "attn_implementation")})
        for name, why in unused.items():
            if getattr(self, name) != defaults[name]:
                raise ConfigError(f"config field {name!r} = {getattr(self, name)!r} {why}")
        # the loss fields set here or in loss_options that the chosen loss does not read (clip_low with sapo, ...)
        loss = self.loss_config()
        if self.truncation == "penalize" and loss.mask_truncated_completions:
            raise ConfigError("config field 'truncation' = 'penalize' with loss_options.mask_truncated_completions: "
                              "the loss drops the truncated completions, so their penalty is never trained on (choose "
                              "one: truncation: mask drops them from the rollout)")
        explicit = [name for name in ("clip_low", "clip_high") if getattr(self, name) is not None]
        for name, why in loss.unused_fields(explicit + list(self.loss_options)).items():
            if name in self.loss_options:
                raise ConfigError(f"config field 'loss_options' = {self.loss_options!r}: {name!r} {why}")
            raise ConfigError(f"config field {name!r} = {getattr(self, name)!r} {why}")


def _coerce(raw: str, current: Any, name: str) -> Any:
    """Parse a command-line string for the field ``name`` whose current value is ``current``."""
    import yaml

    try:
        value = yaml_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--{name}: cannot parse {raw!r}: {exc}") from exc
    if isinstance(current, str) and not isinstance(value, str):
        value = raw  # e.g. --model 123 stays a string
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return value


def _numeric_field(name: str) -> bool:
    f = {f.name: f for f in dataclasses.fields(TrainConfig)}[name]
    return f.type in ("int", "float", "Optional[float]", int, float)


def _bool_field(name: str) -> bool:
    """Whether ``name`` is a true/false field of :class:`TrainConfig` (a bare ``--resume`` flag means true)."""
    return any(f.name == name and f.type in ("bool", bool) for f in dataclasses.fields(TrainConfig))


def _fix_numbers(data: dict) -> dict:
    """A number given as a string (``steps: "2"``, quoted in YAML) becomes a number for the numeric fields."""
    out = dict(data)
    for k, v in data.items():
        if isinstance(v, str) and k in field_names() and _numeric_field(k):
            try:
                out[k] = float(v) if any(c in v for c in ".eE") else int(v)
            except ValueError:
                pass
    return out


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def from_dict(data: dict, source: str = "config") -> TrainConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of option: value, got {type(data).__name__}")
    known = set(field_names())
    unknown = sorted((k for k in data if k not in known), key=repr)  # YAML keys may be numbers, null, booleans
    if unknown:
        import difflib

        def hint(u: Any) -> str:
            close = difflib.get_close_matches(u, known, 1) if isinstance(u, str) else []
            return f"{u!r} (did you mean {close[0]!r}?)" if close else repr(u)

        hints = [hint(u) for u in unknown]
        raise ConfigError(f"{source}: unknown option(s) {', '.join(hints)}")
    return TrainConfig(**_fix_numbers(data))


def load_yaml(path: Union[str, Path]) -> dict:
    import yaml

    path = Path(path)
    if not path.exists() or path.is_dir():  # a pipe (--config <(...)) is read as a file
        raise ConfigError(f"config file {str(path)!r} " + ("is a directory" if path.is_dir() else "does not exist"))
    try:
        data = yaml_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option: value")
    return data


def _bundled_dir() -> Path:
    return Path(str(resources.files("fused_rl.train") / "configs"))


def bundled_config(name: str) -> Path:
    """Path of the config shipped in fused_rl/train/configs as ``NAME.yaml`` (``name`` with or without ``.yaml``)."""
    stem = name[:-5] if name.endswith(".yaml") else name
    path = _bundled_dir() / f"{stem}.yaml"
    if not path.is_file():
        raise ConfigError(f"no bundled config {name!r}; bundled: {bundled_names()}")
    return path


def bundled_names() -> list[str]:
    return sorted(p.stem for p in _bundled_dir().glob("*.yaml"))


def _looks_like_a_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.endswith((".yaml", ".yml"))


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                **kwargs: Any) -> TrainConfig:
    """``path`` (a YAML file, or the name of a bundled config such as ``smollm2`` or ``smollm2.yaml`` where no
    such file exists; None: the embedded default), then ``overrides``
    (``["--key", "value", ...]`` or ``["--key=value"]``; a true/false option given bare, ``["--resume"]``, is true),
    then ``kwargs``; validated."""
    if path is None:
        path = str(bundled_config("default"))
    elif not Path(path).exists() or Path(path).is_dir():  # a directory named like a bundled config does not hide it
        bundled = Path(path).name == path and Path(path).stem in bundled_names() and Path(path).suffix in ("", ".yaml")
        if _looks_like_a_path(path) and not bundled:
            what = "is a directory" if Path(path).is_dir() else "does not exist"
            raise ConfigError(f"config file {path!r} {what} (bundled configs, by name: {bundled_names()})")
        path = str(bundled_config(path))
    data = load_yaml(path)
    cfg = from_dict(data, source=str(path))
    file_task, file_model = cfg.task, cfg.model
    task_args_set = "task_args" in kwargs
    model_config_set = "model_config" in kwargs
    dotted_task_args: dict[str, str] = {}  # applied once the task is known (its parameters' types)
    dotted_model_config: dict[str, Any] = {}  # applied once the model is known (a file's sizes dropped or not)
    dotted_loss_options: dict[str, Any] = {}  # applied last: a later whole --loss_options mapping dropped them
    items = list(overrides or [])
    i = 0
    while i < len(items):
        arg = items[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected --key value, got {arg!r}")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            raw = items[i + 1]
            i += 2
        elif _bool_field(key.replace("-", "_")):  # a bare --resume: true
            raw = "true"
            i += 1
        else:
            nxt = f" (the next argument, {items[i + 1]!r}, is an option; a value that starts with -- is given " \
                  f"as --{key}=VALUE)" if i + 1 < len(items) else ""
            raise ConfigError(f"--{key} needs a value{nxt}")
        key = key.replace("-", "_")
        if "." in key:  # --model_config.hidden_size 96
            top, sub = key.split(".", 1)
            if top not in ("task_args", "model_config", "loss_options"):
                raise ConfigError(f"--{key}: only task_args.X, model_config.X and loss_options.X take a dotted key")
            if top == "task_args":
                dotted_task_args[sub] = raw
            elif top == "model_config":
                dotted_model_config[sub] = _coerce(raw, None, key)
            else:
                dotted_loss_options[sub] = _coerce(raw, None, key)
            continue
        if key not in field_names():
            import difflib

            close = difflib.get_close_matches(key, field_names(), 1)
            raise ConfigError(f"unknown option --{key}" + (f" (did you mean --{close[0]}?)" if close else ""))
        value = _coerce(raw, getattr(cfg, key), key)
        setattr(cfg, key, _fix_numbers({key: value})[key])
        task_args_set |= key == "task_args"
        model_config_set |= key == "model_config"
    for key, value in kwargs.items():
        if key not in field_names():
            raise ConfigError(f"unknown option {key!r}")
        setattr(cfg, key, value)
    if cfg.task != file_task and not task_args_set:
        cfg.task_args = {}  # the file's task_args were its own task's
    if cfg.model != file_model and not model_config_set:
        cfg.model_config = {}  # the file's model_config sized its own (tiny) model
    if dotted_model_config:
        cfg.model_config = {**cfg.model_config, **dotted_model_config}
    if dotted_loss_options:
        if not isinstance(cfg.loss_options, dict):
            raise ConfigError(f"--loss_options must be a mapping of PolicyLossConfig fields, got {cfg.loss_options!r}")
        cfg.loss_options = {**cfg.loss_options, **dotted_loss_options}
    for sub, raw in dotted_task_args.items():
        cfg.task_args[sub] = _coerce_task_arg(cfg.task, sub, raw)
    return cfg.validate()


def _coerce_task_arg(task: str, name: str, raw: str) -> Any:
    """``--task_args.NAME raw``: a string where the task's parameter defaults to one (``--task_args.digits 012``
    stays "012"), else parsed as YAML."""
    import inspect

    from .tasks import TASKS

    param = inspect.signature(TASKS[task]).parameters.get(name) if task in TASKS else None
    if param is not None and isinstance(param.default, str):
        return raw
    return _coerce(raw, None, f"task_args.{name}")


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
