"""Built-in verifiable tasks and reward functions.

A *task* yields examples ``{"prompt": str, "answer": str, ...}``; a *reward function* has the
signature ``f(prompts, completions, **batch) -> list[float]`` where ``batch`` holds the other example
fields as lists (``answer=[...]``), one entry per completion. Built-in rewards:

* ``exact_match``: ``1`` if ``completion.strip() == answer`` else ``0``;
* ``partial_match``: ``(# positions i with completion[i] == answer[i]) / max(len(completion), len(answer))``
  (partial credit, 1 only for the exact answer);
* ``numeric``: ``1`` if the number extracted from the completion equals the answer: the number after
  a GSM8K-style ``#### 42`` marker if present, else the last number in the text;
* ``format``: ``1`` if the completion matches ``format_regex`` (default: a GSM8K-style ``#### <number>``
  final line), else ``0``.

A user reward is given as ``"package.module:function"`` or ``"path/to/file.py:function"``.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import math
import random
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch

RewardFn = Callable[..., Sequence[float]]


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something other than one finite number per completion."""


# ---------------------------------------------------------------------------------------------- rewards
#: a number: digits with thousands separators ``1,234`` (a comma followed by exactly three digits), a decimal
#: part, a leading ``.5``, a sign that is not a range's dash (``2024-2025``: 2025), an exponent ``1e3``
_NUMBER_BODY = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:(?<=\d)[eE][-+]?\d+)?(?<=\d)"
_NUMBER = re.compile(r"(?<![\d.])" + _NUMBER_BODY)
_GSM8K = re.compile(r"####\s*(" + _NUMBER_BODY + ")")


def extract_number(text: str) -> Optional[float]:
    """The answer number in ``text``: after ``####`` if present, else the last number; None if none."""
    m = _GSM8K.search(text)
    raw = m.group(1) if m else (_NUMBER.findall(text) or [None])[-1]
    if raw is None:
        return None
    try:
        return float(raw.replace(",", ""))
    except ValueError:
        return None


def exact_match(prompts, completions, answer, **_) -> list[float]:
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def partial_match(prompts, completions, answer, **_) -> list[float]:
    out = []
    for c, a in zip(completions, answer):
        c, a = c.strip(), str(a).strip()
        n = max(len(c), len(a), 1)
        out.append(sum(x == y for x, y in zip(c, a)) / n)
    return out


def numeric(prompts, completions, answer, **_) -> list[float]:
    out = []
    for c, a in zip(completions, answer):
        got, want = extract_number(c), extract_number(str(a))
        out.append(float(got is not None and want is not None and math.isclose(got, want, rel_tol=0, abs_tol=1e-6)))
    return out


DEFAULT_FORMAT = r"(?s).*####\s*-?[\d,]*\.?\d+\s*$"


def format_reward(prompts, completions, format_regex=None, **_) -> list[float]:
    out = []
    for i, c in enumerate(completions):
        pattern = format_regex[i] if isinstance(format_regex, (list, tuple)) else format_regex
        pattern = pattern or DEFAULT_FORMAT  # a row without its own regex
        out.append(float(re.fullmatch(pattern, c.strip()) is not None))
    return out


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "partial_match": partial_match,
    "numeric": numeric,
    "format": format_reward,
}


def resolve_reward(spec: str) -> tuple[str, RewardFn]:
    """A built-in name, ``module:function`` or ``file.py:function`` -> (name, callable)."""
    if spec in BUILTIN_REWARDS:
        return spec, BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise RewardFunctionError(f"unknown reward {spec!r}: use one of {sorted(BUILTIN_REWARDS)} or "
                                  "'package.module:function' / 'path/to/file.py:function'")
    target, func_name = spec.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise FileNotFoundError(f"no such file {target!r}")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except Exception as exc:
        raise RewardFunctionError(f"cannot import reward {spec!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward {spec!r}: {target} has no callable {func_name!r}")
    return spec, fn


def _real_number(v) -> float:
    """``float(v)`` of a real scalar: a Python / numpy number, a bool, a ``Decimal``, a 0-d tensor or array; a
    string (``"1"``), a sequence or a complex number raises ``TypeError`` / ``ValueError``."""
    if isinstance(v, (str, bytes, complex)) or getattr(v, "ndim", 0) != 0 or getattr(v, "is_complex", lambda: False)():
        raise TypeError(f"not a real number: {v!r}")
    return float(v)


def _short(v) -> str:
    """``str(v)``, its middle cut out past 40 characters (a reward value for an error message)."""
    try:
        text = str(v)
    except ValueError:  # an int past Python's 4300-digit limit on str()
        return f"{type(v).__name__} too large to print"
    return text if len(text) <= 40 else f"{text[:18]}...{text[-18:]}"


def call_reward(name: str, fn: RewardFn, prompts: list[str], completions: list[str], batch: dict) -> torch.Tensor:
    """Call ``fn`` on copies of its inputs (the lists, and ``batch``'s values deeply: a reward that changes them in
    place cannot change what the next reward function, the task's rows or the rollout see) and check its result:
    a sequence (list, tuple, array, tensor) of one real number per completion, each finite in float32; returns
    them as a new float32 tensor. Failures raise :class:`RewardFunctionError` naming ``name``."""
    try:
        result = fn(list(prompts), list(completions), **copy.deepcopy(batch))
    except Exception as exc:
        raise RewardFunctionError(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
    values = result.tolist() if hasattr(result, "tolist") else result
    # not a dict, set, string or generator: they would be read as their keys, members in any order or characters
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise RewardFunctionError(f"reward function {name!r} must return a list of numbers, got "
                                  f"{type(result).__name__}")
    floats = []
    for i, v in enumerate(values):
        try:
            floats.append(_real_number(v))
        except OverflowError:  # an int or Fraction beyond any float: refused as non-finite below
            floats.append(math.inf)
        except (TypeError, ValueError):
            if v is None:
                raise RewardFunctionError(
                    f"reward function {name!r} returned None at index {i}: every completion needs a number (TRL's "
                    "None for 'does not apply' is not supported; return 0.0, what TRL's weighted sum counts a None "
                    "as)") from None
            raise RewardFunctionError(f"reward function {name!r} must return a list of numbers, got "
                                      f"{type(v).__name__} {v!r} at index {i}") from None
    if len(values) != len(completions):
        raise RewardFunctionError(f"reward function {name!r} returned {len(values)} values for "
                                  f"{len(completions)} completions (it must return one per completion)")
    rewards = torch.tensor(floats, dtype=torch.float32)
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise RewardFunctionError(f"reward function {name!r} returned a non-finite value at index {bad[0]}: "
                                  f"{_short(values[bad[0]])} (rewards are float32: finite up to about 3.4e38)")
    return rewards


# ---------------------------------------------------------------------------------------------- tasks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Task:
    """A source of examples; ``sample(rng, n)`` draws ``n`` training examples, ``heldout(n)`` a fixed
    evaluation set. Generated tasks hold out one prompt in ``HELDOUT_ONE_IN`` by a stable hash of its
    text (training never draws those; the evaluation draws only those), so the evaluation is of unseen
    prompts; a task too small to have any such prompt evaluates on training prompts (a tiny task's
    reward is then not a generalization measure)."""

    #: one prompt in this many (by CRC-32 of its text) is held out of training
    HELDOUT_ONE_IN = 10
    #: draws tried per requested example before a filter gives up (the prompt space lacks that side)
    MAX_TRIES = 1000

    name = "task"
    default_rewards: tuple = ("exact_match",)
    #: characters a character-level tokenizer needs for this task
    alphabet: str = ""

    def make(self, rng: random.Random) -> dict:
        raise NotImplementedError

    def is_heldout(self, example: dict) -> bool:
        return zlib.crc32(example["prompt"].encode()) % self.HELDOUT_ONE_IN == 0

    def _draw(self, rng: random.Random, n: int, heldout: bool) -> list[dict]:
        out: list[dict] = []
        for _ in range(self.MAX_TRIES * n):
            if len(out) == n:
                return out
            example = self.make(rng)
            if self.is_heldout(example) == heldout:
                out.append(example)
        if len(out) == n:
            return out
        return out + [self.make(rng) for _ in range(n - len(out))]  # a prompt space without that side

    def sample(self, rng: random.Random, n: int) -> list[dict]:
        return self._draw(rng, n, heldout=False)

    def heldout(self, n: int) -> list[dict]:
        """Up to ``n`` *distinct* held-out prompts (fewer when the held-out space is smaller; a task with no
        held-out prompt at all evaluates on training prompts, as before)."""
        rng, out, seen = random.Random(10_000_019), [], set()
        for _ in range(self.MAX_TRIES * n):
            if len(out) == n:
                break
            example = self.make(rng)
            if self.is_heldout(example) and example["prompt"] not in seen:
                seen.add(example["prompt"])
                out.append(example)
        return out or self._draw(random.Random(10_000_019), n, heldout=False)


class ReverseTask(Task):
    """Reverse a string of ``min_digits..max_digits`` digits: ``"4071="`` -> ``"1704"``
    (``mode="copy"``: repeat it, ``"4071="`` -> ``"4071"``).

    Default reward: ``partial_match`` (fraction of positions right), so a random policy earns about
    1/13 per position and the exact answer earns 1."""

    name = "reverse"
    default_rewards = ("partial_match",)
    alphabet = "0123456789="

    def __init__(self, min_digits: int = 3, max_digits: int = 3, digits: str = "0123456789", mode: str = "reverse"):
        if not (_is_int(min_digits) and _is_int(max_digits) and 1 <= min_digits <= max_digits):
            raise ValueError(f"{self.name} task: need integers 1 <= min_digits <= max_digits, got {min_digits!r}, "
                             f"{max_digits!r}")
        if mode not in ("reverse", "copy"):
            raise ValueError(f"{self.name} task: mode must be 'reverse' or 'copy', got {mode!r}")
        if not digits or set(digits) - set("0123456789"):
            raise ValueError(f"{self.name} task: digits must be a non-empty subset of 0-9, got {digits!r}")
        self.min_digits, self.max_digits, self.digits, self.mode = min_digits, max_digits, digits, mode

    def make(self, rng: random.Random) -> dict:
        n = rng.randint(self.min_digits, self.max_digits)
        s = "".join(rng.choice(self.digits) for _ in range(n))
        return {"prompt": s + "=", "answer": s[::-1] if self.mode == "reverse" else s}


class CopyTask(ReverseTask):
    """Repeat a string of digits: ``"407="`` -> ``"407"`` (the embedded default's task)."""

    name = "copy"

    def __init__(self, min_digits: int = 3, max_digits: int = 3, digits: str = "0123456789"):
        super().__init__(min_digits, max_digits, digits, mode="copy")


class AddTask(Task):
    """Add two numbers of ``1..max_digits`` digits: ``"12+7="`` -> ``"19"`` (reward ``partial_match``
    on the digits; use ``rewards: [numeric]`` for all-or-nothing)."""

    name = "add"
    default_rewards = ("partial_match",)
    alphabet = "0123456789+="

    def __init__(self, max_digits: int = 2):
        if not _is_int(max_digits) or max_digits < 1:
            raise ValueError(f"add task: max_digits must be an integer >= 1, got {max_digits!r}")
        self.max_digits = max_digits

    def make(self, rng: random.Random) -> dict:
        hi = 10 ** self.max_digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


class ArithmeticTask(Task):
    """Natural-language arithmetic for a pretrained model: ``"What is 12 + 7? ..."`` -> ``19``, graded by
    ``numeric`` (GSM8K-style ``#### 19`` or the last number) plus an optional ``format`` reward."""

    name = "arithmetic"
    default_rewards = ("numeric",)

    OPS = "+-*"

    def __init__(self, max_value: int = 20, ops: str = "+-", suffix: str = " Answer with just the number."):
        if not _is_int(max_value) or max_value < 0:
            raise ValueError(f"arithmetic task: max_value must be an integer >= 0, got {max_value!r}")
        if not isinstance(ops, str) or not ops or set(ops) - set(self.OPS):
            raise ValueError(f"arithmetic task: ops must be a non-empty string of '+', '-', '*', got {ops!r}")
        if not isinstance(suffix, str):
            raise ValueError(f"arithmetic task: suffix must be a string, got {suffix!r}")
        self.max_value, self.ops, self.suffix = max_value, ops, suffix

    def make(self, rng: random.Random) -> dict:
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        op = rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return {"prompt": f"What is {a} {op} {b}?{self.suffix}", "answer": str(value)}


class JsonlTask(Task):
    """Examples from a JSONL file with ``prompt`` and ``answer`` keys (e.g. GSM8K: answers ``... #### 42``
    are graded by ``numeric``). The last ``heldout_fraction`` of the file (at least one row) is the held-out
    set; training rows whose prompt is also a held-out one are dropped."""

    name = "jsonl"
    default_rewards = ("numeric",)

    def __init__(self, path: str, heldout_fraction: float = 0.1, prompt_key: str = "prompt",
                 answer_key: str = "answer"):
        import json

        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"jsonl task: heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"jsonl task: no such file {path!r}")
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):  # n: the file's line number, blank lines too
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"jsonl task: line {n} of {path} is not JSON: {exc.msg} at column "
                                 f"{exc.colno}") from exc
            if not isinstance(r, dict):
                raise ValueError(f"jsonl task: line {n} of {path} is not a JSON object but a {type(r).__name__}")
            if prompt_key not in r or answer_key not in r:
                raise ValueError(f"jsonl task: line {n} of {path} lacks {prompt_key!r} or {answer_key!r}")
            if not isinstance(r[prompt_key], str) or not r[prompt_key].strip():
                raise ValueError(f"jsonl task: line {n} of {path}: {prompt_key!r} must be a non-empty string, "
                                 f"got {r[prompt_key]!r}")
            if r[answer_key] is None:
                raise ValueError(f"jsonl task: line {n} of {path}: {answer_key!r} is null")
            rows.append({**r, "prompt": r[prompt_key], "answer": str(r[answer_key])})
        if len(rows) < 2:
            raise ValueError(f"jsonl task: {path} needs at least 2 rows (training and held-out), has {len(rows)}")
        cut = min(len(rows) - 1, max(1, int(len(rows) * (1 - heldout_fraction))))
        self.heldout_rows = rows[cut:]
        heldout = {r["prompt"] for r in self.heldout_rows}
        self.train_rows = [r for r in rows[:cut] if r["prompt"] not in heldout]
        if not self.train_rows:
            raise ValueError(f"jsonl task: every training prompt of {path} is also a held-out one")

    def make(self, rng: random.Random) -> dict:
        return dict(rng.choice(self.train_rows))

    def is_heldout(self, example: dict) -> bool:
        return False  # make() draws from the training rows only: the split is the file's

    def heldout(self, n: int) -> list[dict]:
        return [dict(r) for r in self.heldout_rows[:n]]


TASKS = {"copy": CopyTask, "reverse": ReverseTask, "add": AddTask, "arithmetic": ArithmeticTask, "jsonl": JsonlTask}


def make_task(name: str, args: dict) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    try:
        return TASKS[name](**args)
    except TypeError as exc:
        raise ValueError(f"task {name!r}: bad task_args {args!r}: {exc}") from exc


def batch_fields(examples: list[dict]) -> dict[str, list[Any]]:
    """``[{"prompt", "answer", ...}]`` -> ``{"answer": [...], ...}`` (everything but the prompt; the keys of
    every example, ``None`` where one lacks a key)."""
    keys = list(dict.fromkeys(k for e in examples for k in e if k != "prompt"))
    return {k: [e.get(k) for e in examples] for k in keys}
