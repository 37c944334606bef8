"""The Python snippets of README.md and docs/*.md run as written and compute what the reference computes; their YAML
configs and ``fused-rl train`` lines are valid.

Each fenced ``python`` block runs, statement by statement, in a namespace of small CPU tensors named as the snippets
name them (:func:`namespace`); a paragraph (blank-line separated) that needs what no test machine has (a model id to
download) is listed in :data:`SKIP`. Each block runs twice: as written (``backend="auto"``, i.e. the C++ or chunked
torch kernels; an explicit backend as named) and with every backend the reference. Every tensor each statement binds
(outputs, metrics, tuples of them; a name bound again is compared each time) and every gradient the block leaves on
the inputs must agree. Blocks with nothing to compare: :data:`NO_TENSORS` (imports, a reward function, checked
otherwise); the verl block's ``compute_policy_loss`` runs ``loss_math`` on log-probs, the same code either way.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import types
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

import fused_rl
from fused_rl import PolicyLossConfig
from fused_rl.backends import AUTO_ORDER
from helpers import triton_interpreter_reason

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: (file, block, paragraph) -> text the skipped paragraph holds: it builds a TRL trainer from a model id (a download)
SKIP = {("README.md", 2, 0): "FusedGRPOTrainer(model=", ("migration.md", 1, 1): "FusedGRPOTrainer(model="}
#: the fenced python blocks per file: a renamed fence or a dropped block fails :func:`test_the_snippets_are_found`
BLOCK_COUNTS = {"README.md": 2, "migration.md": 5, "linear.md": 1, "native.md": 1, "train.md": 1, "triton.md": 1}
NO_TENSORS = {("migration.md", 1), ("train.md", 1)}
B, T, V, H = 4, 6, 50, 16
BACKEND_ARG = re.compile(r"""backend=(["'])(\w+)\1""")


def python_blocks(path: Path) -> list[str]:
    """The fenced ``python`` blocks of a Markdown file, in order."""
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.M | re.S)


BLOCKS = [(path.name, i, code) for path in DOCS for i, code in enumerate(python_blocks(path), start=1)]


def namespace() -> dict:
    """The names the snippets use, as small seeded CPU tensors (logits, hidden states and per-token log-probs
    require gradients)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    logp_like = lambda: -torch.rand(B, T, generator=g) * 3  # noqa: E731
    lm_head = torch.nn.Linear(H, V)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
        lm_head.bias.copy_(torch.randn(V, generator=g) * 0.1)
    targets = torch.randint(0, V, (B, T), generator=g)
    old, ref, rollout = logp_like(), logp_like(), logp_like()
    n_tokens = int(mask.sum())
    verl_config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                                  policy_loss=SimpleNamespace(loss_mode="vanilla"))
    args = SimpleNamespace(rollout=SimpleNamespace(temperature=0.9), actor=SimpleNamespace(entropy_coef=0.01),
                           algo=SimpleNamespace(kl=SimpleNamespace(use_loss=True, estimator="k3",
                                                                   unbiased_gradient=False)))
    return dict(
        torch=torch, fused_rl=fused_rl, PolicyLossConfig=PolicyLossConfig,
        logits=(torch.randn(B, T, V, generator=g) * 2).requires_grad_(), targets=targets,
        advantages=torch.randn(B, generator=g), mask=mask, old=old, ref=ref, n_tokens=n_tokens, n=n_tokens,
        hidden=torch.randn(B, T, H, generator=g).requires_grad_(), lm_head=lm_head,
        cfg=PolicyLossConfig.preset("dapo"),
        rewards=(torch.rand(16, generator=g) > 0.5).float(),
        ids=targets, completion_ids=targets, completion_mask=mask.long(),
        # Liger's shifted layout: logits (B, T+1, V) scoring ids (B, T); whole sequences with a 2-token prompt
        policy_logits=(torch.randn(B, T + 1, V, generator=g) * 2).requires_grad_(), old_logp=old, ref_logp=ref,
        input_ids=torch.cat([torch.randint(0, V, (B, 2), generator=g), targets], 1),
        attention_mask=torch.cat([torch.ones(B, 2, dtype=torch.long), mask.long()], 1),
        g1=torch.randn(B, T, generator=g), g2=torch.randn(B, T, generator=g),
        # verl
        old_log_prob=old, log_prob=(old + 0.1 * torch.randn(B, T, generator=g)).requires_grad_(),
        response_mask=mask.float(), loss_agg_mode="token-mean", actor_config=verl_config,
        # OpenRLHF
        log_probs=(old + 0.1 * torch.randn(B, T, generator=g)).requires_grad_(), old_log_probs=old,
        action_mask=mask, rollout_log_probs=rollout, action_ids=targets, base_action_log_probs=ref,
        loss_batch_info=dict(dp_size=1, batch_num_tokens=n_tokens, global_batch_size=B), kl_ctl=0.01, args=args,
    )


@pytest.fixture
def fake_verl(monkeypatch) -> dict:
    """``verl.trainer.ppo.core_algos.register_policy_loss`` recording what the snippet registers (verl itself is not
    installed for the tests)."""
    registered = {}

    def register_policy_loss(name):
        def deco(fn):
            registered[name] = fn
            return fn
        return deco

    names = ["verl", "verl.trainer", "verl.trainer.ppo", "verl.trainer.ppo.core_algos"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["verl.trainer.ppo.core_algos"].register_policy_loss = register_policy_loss
    return registered


def paragraphs(code: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", code) if p.strip()]


def run_block(name: str, index: int, code: str, reference: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """The namespace after the block, and every tensor each of its statements bound, keyed by paragraph, statement and
    name."""
    ns = namespace()
    bound: dict[str, torch.Tensor] = {}
    for j, para in enumerate(paragraphs(code)):
        if (marker := SKIP.get((name, index, j))) is not None:
            assert marker in para, (name, index, j, "the SKIP entry names another paragraph")
            continue
        if reference:
            para = BACKEND_ARG.sub('backend="reference"', para)
        for k, stmt in enumerate(ast.parse(para).body):
            before = dict(ns)
            exec(compile(ast.Module([stmt], type_ignores=[]), f"{name}:python block {index}, paragraph {j}", "exec"),
                 ns)
            for key, value in ns.items():
                if key not in before or before[key] is not value:
                    bound.update(tensors(value, f"{j}.{k}.{key}"))
    return ns, bound


def tensors(obj, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` (tensors, tuples, lists, dicts, dataclasses), with its path."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in tensors(v, f"{path}.{k}")]
    if isinstance(obj, (tuple, list)):
        return [t for i, v in enumerate(obj) for t in tensors(v, f"{path}[{i}]")]
    return []


def results(name: str, index: int, code: str, reference: bool) -> dict[str, Optional[torch.Tensor]]:
    """The tensors a block's statements bound and the gradients it left on the inputs."""
    ns, out = run_block(name, index, code, reference)
    for key in ("logits", "policy_logits", "hidden", "log_prob", "log_probs"):
        out[f"{key}.grad"] = ns[key].grad
    for pname, param in ns["lm_head"].named_parameters():
        out[f"lm_head.{pname}.grad"] = param.grad
    return out


def test_the_snippets_are_found():
    """The docs have the blocks this file runs (a renamed fence would silently drop one), and every SKIP entry
    names a paragraph that exists."""
    assert Counter(name for name, _, _ in BLOCKS) == BLOCK_COUNTS
    assert len(YAML_BLOCKS) == 2 and len(TRAIN_LINES) >= 10
    code = {(name, i): c for name, i, c in BLOCKS}
    for (name, i, j), marker in SKIP.items():
        assert marker in paragraphs(code[(name, i)])[j], (name, i, j)


@pytest.mark.parametrize("name, index, code", BLOCKS, ids=[f"{n}-{i}" for n, i, _ in BLOCKS])
def test_snippet_runs_and_matches_the_reference(name, index, code, fake_verl, monkeypatch):
    if any(m.group(2) == "triton" for m in BACKEND_ARG.finditer(code)) and (reason := triton_interpreter_reason()):
        pytest.skip(reason)
    fused = results(name, index, code, reference=False)
    registered_fused = dict(fake_verl)
    monkeypatch.setitem(AUTO_ORDER, "cpu", ("reference",))
    reference = results(name, index, code, reference=True)
    assert fused.keys() == reference.keys()
    assert (not any(v is not None for v in fused.values())) == ((name, index) in NO_TENSORS)
    for key, expected in reference.items():
        actual = fused[key]
        assert (actual is None) == (expected is None), key
        if expected is not None:
            torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-4, msg=lambda m, k=key: f"{k}: {m}")
    if re.search(r"^register_policy_loss\(", code, flags=re.M):
        assert set(registered_fused) == {"fused_vanilla"} and callable(registered_fused["fused_vanilla"])
    if "def brevity" in code:
        ns, _ = run_block(name, index, code, reference=False)
        assert ns["brevity"](["p", "q"], ["short", "x" * 300], answer=[None, None]) == [1.0, 0.0]


# ------------------------------------------------------------------------------ the trainer's YAML and command lines
YAML_BLOCKS = [(path.name, code) for path in DOCS
               for code in re.findall(r"^```ya?ml\n(.*?)^```", path.read_text(), flags=re.M | re.S)]


def train_commands(text: str) -> list[list[str]]:
    """The arguments of each ``fused-rl train`` command of a Markdown text: lines that start with it (comments cut)
    and inline code spans (across a line break too)."""
    lines = [line.split("#")[0] for line in text.splitlines() if line.strip().startswith("fused-rl train")]
    return [cmd.split()[2:] for cmd in lines + re.findall(r"`(fused-rl train\b[^`]*)`", text)]


TRAIN_LINES = [(path.name, argv) for path in DOCS for argv in train_commands(path.read_text())]


@pytest.mark.parametrize("name, text", YAML_BLOCKS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(YAML_BLOCKS)])
def test_yaml_snippet_is_a_valid_trainer_config(name, text):
    """Each YAML block of the docs is a valid trainer config whose every key reads back as written."""
    from fused_rl.train.config import from_dict, to_dict, yaml_load

    data = yaml_load(text)
    written = to_dict(from_dict(data, source=name).validate())
    assert {key: written[key] for key in data} == data


@pytest.mark.parametrize("name, argv", TRAIN_LINES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TRAIN_LINES)])
def test_train_command_line_is_valid(name, argv, tmp_path, monkeypatch):
    """Each ``fused-rl train`` line of the docs parses to a valid config, its flags applied as written (a ``--config``
    file the line names but does not ship is an empty file here)."""
    from fused_rl.train.config import bundled_names, load_config, yaml_load

    monkeypatch.chdir(tmp_path)
    config = None
    if "--config" in argv:
        i = argv.index("--config")
        config, argv = argv[i + 1], argv[:i] + argv[i + 2:]
        if config not in bundled_names():
            (tmp_path / config).write_text("{}\n")
    cfg = load_config(config, argv)
    flags = dict(zip(argv[::2], argv[1::2]))
    for flag, raw in flags.items():
        *parents, leaf = flag.removeprefix("--").split(".")
        value = cfg
        for part in parents:
            value = getattr(value, part) if not isinstance(value, dict) else value[part]
        value = value[leaf] if isinstance(value, dict) else getattr(value, leaf)
        assert value == yaml_load(raw), flag
