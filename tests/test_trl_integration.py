"""Stock TRL ``GRPOTrainer`` vs ``fused_rl.integrations.trl.FusedGRPOTrainer``, same seed, tiny local model.

Both trainers start from the same saved random Llama (no download) and the same seed, generate the
same completions and must log the same losses and metrics and produce the same gradients at every
optimizer step (SGD, no gradient clipping, so each gradient is seen unscaled).
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from fused_rl.integrations.trl import FusedGRPOTrainer, patch_grpo_trainer, unsupported_options  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz "
#: Backend of the fused trainer: the shipped default ("auto": the cpu backend's tiled fused-linear route on CPU).
LINEAR_BACKEND = os.environ.get("FUSED_RL_TEST_LINEAR_BACKEND", "auto")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a busy 2-core machine are ~20x faster single-threaded (both trainers alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama and a character-level tokenizer, saved locally (TRL reloads the ref model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_llama")
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>")
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab) + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def reward_fn(completions, **kwargs):
    """Deterministic: vowels count +1, everything else -0.25 (varied rewards within each group)."""
    return [sum(1.0 if ch in "aeiou" else -0.25 for ch in c) for c in completions]


class GradRecorder(transformers.TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def run(model_dir, trainer_cls, tmp_path, *, max_steps=3, patch=False, trainer_kwargs=None, **overrides):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    kwargs = dict(output_dir=str(tmp_path / trainer_cls.__name__), use_cpu=True, report_to="none", bf16=False,
                  per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
                  max_completion_length=8, max_steps=max_steps, logging_steps=1, learning_rate=0.05, optim="sgd",
                  max_grad_norm=0.0, lr_scheduler_type="constant", seed=7, save_strategy="no",
                  disable_tqdm=True, dataloader_num_workers=0)
    kwargs.update(overrides)
    args = GRPOConfig(**kwargs)
    dataset = Dataset.from_dict({"prompt": ["abc", "hello there", "xyz q", "the cat", "mo", "dog e"]})
    recorder = GradRecorder()
    extra = {"fused_backend": LINEAR_BACKEND} if trainer_cls is FusedGRPOTrainer else {}
    trainer = trainer_cls(model=model_dir, reward_funcs=reward_fn, args=args, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[recorder], **extra,
                          **(trainer_kwargs or {}))
    if patch:
        patch_grpo_trainer(trainer, backend=LINEAR_BACKEND)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return logs, recorder.grads, params


#: Metrics both trainers must log identically (when present in the stock log).
METRIC_KEYS = ("loss", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
               "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean",
               "completions/mean_length", "reward")

CASES = {
    "grpo-beta0": dict(loss_type="grpo", beta=0.0),
    "grpo-beta-iter2-temp": dict(loss_type="grpo", beta=0.1, num_iterations=2, temperature=0.7, epsilon=0.05),
    "grpo-beta-iter2-nocorr": dict(loss_type="grpo", beta=0.1, num_iterations=2, epsilon=0.05,
                                   use_bias_correction_kl=False),
    "bnpo-beta": dict(loss_type="bnpo", beta=0.1, num_iterations=2, epsilon=0.05),
    "bnpo-beta0-iter2": dict(loss_type="bnpo", beta=0.0, num_iterations=2, epsilon=0.05),
    "dr_grpo-beta0-iter2": dict(loss_type="dr_grpo", beta=0.0, num_iterations=2, epsilon=0.05),
    "dr_grpo-beta": dict(loss_type="dr_grpo", beta=0.04),
    "dapo-beta0": dict(loss_type="dapo", beta=0.0),
    "dapo-beta0-iter2": dict(loss_type="dapo", beta=0.0, num_iterations=2, epsilon=0.05, epsilon_high=0.08),
    "dapo-beta": dict(loss_type="dapo", beta=0.04, num_iterations=2, epsilon=0.05, epsilon_high=0.08),
    # steps_per_generation 4 > accumulation 2: dapo's normalizer rescales num_items_in_batch by 2 / 4
    "dapo-beta-spg4": dict(loss_type="dapo", beta=0.04, steps_per_generation=4, epsilon=0.05),
    "cispo-iter2": dict(loss_type="cispo", beta=0.0, num_iterations=2, epsilon_high=1.02),
    "sapo-iter2": dict(loss_type="sapo", beta=0.02, num_iterations=2, sapo_temperature_pos=2.0,
                       sapo_temperature_neg=0.5),
    "delta-iter2": dict(loss_type="grpo", beta=0.0, num_iterations=2, epsilon=0.002, delta=1.003),
    "top-entropy": dict(loss_type="bnpo", beta=0.04, top_entropy_quantile=0.5),
    "off-policy-mask-iter2": dict(loss_type="dapo", beta=0.0, num_iterations=2, off_policy_mask_threshold=0.005),
    "gspo-seq-iter2": dict(loss_type="grpo", beta=0.02, num_iterations=2, importance_sampling_level="sequence",
                           epsilon=0.01, epsilon_high=0.01),
    "luspo-seq-iter2": dict(loss_type="luspo", beta=0.02, num_iterations=2, importance_sampling_level="sequence",
                            epsilon=0.01, epsilon_high=0.01),
    "luspo-token-iter2": dict(loss_type="luspo", beta=0.0, num_iterations=2, epsilon=0.05),
    "vespo-iter2": dict(loss_type="vespo", beta=0.04, num_iterations=2),
    # k - lam w ~ 3 at w = 1 (k_neg 4): the loss moves 3x the log-ratio rounding; these parameters with
    # steps_per_generation 4 put the second step's loss (-0.128, a sum of O(1) terms) 1.7e-6 and 3.2e-6 from stock
    # TRL's in two runs, while each trainer moved 0.4e-6 / 1.1e-6 between its own runs (gradients within 3.4e-6)
    "vespo-params-iter2": dict(loss_type="vespo", beta=0.02, num_iterations=2, vespo_k_pos=1.5, vespo_lambda_pos=0.5,
                               vespo_k_neg=4.0, vespo_lambda_neg=1.0),
    "vespo-spg4": dict(loss_type="vespo", beta=0.0, steps_per_generation=4),
    # TRL zeroes the completion (and attention) mask of truncated completions: rows with no token, as TRL's
    "grpo-mask-truncated-iter2": dict(loss_type="grpo", beta=0.04, num_iterations=2, epsilon=0.05,
                                      mask_truncated_completions=True),
    # sequence-level ratio with a token-sum loss (TRL warns but computes it): fused_rl's gspo, agg as dapo
    "dapo-seq-iter2": dict(loss_type="dapo", beta=0.02, num_iterations=2, importance_sampling_level="sequence",
                           epsilon=0.01, cast_lm_head_to_fp32=True),
}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused loss calls, so a test cannot pass by silently running TRL's own loss."""
    import fused_rl.integrations.trl as integration

    calls = []
    original = integration.linear_policy_loss

    def counting(*args, **kwargs):
        calls.append(kwargs.get("config"))
        return original(*args, **kwargs)

    monkeypatch.setattr(integration, "linear_policy_loss", counting)
    return calls


def assert_same_training(stock, fused):
    stock_logs, stock_grads, stock_params = stock
    fused_logs, fused_grads, fused_params = fused

    assert len(stock_logs) == len(fused_logs) == 3
    for step, (s, f) in enumerate(zip(stock_logs, fused_logs)):
        for key in METRIC_KEYS:
            if key not in s:
                continue
            assert key in f, f"step {step}: fused trainer did not log {key!r}"
            assert math.isclose(f[key], s[key], rel_tol=1e-5, abs_tol=1e-6), \
                f"step {step} {key}: fused {f[key]!r} vs stock {s[key]!r}"
        extra = set(f) - set(s)
        assert not extra, f"fused trainer logged metrics TRL does not: {extra}"
    assert len(stock_grads) == len(fused_grads) == 3
    nonzero = 0
    for step, (gs, gf) in enumerate(zip(stock_grads, fused_grads)):
        assert gs.keys() == gf.keys()
        for name in gs:
            err = _rel_err(gf[name], gs[name])
            assert err < 1e-5 or (gs[name] - gf[name]).abs().max() < 1e-8, \
                f"step {step} grad {name}: relative error {err:.2e}"
            nonzero += int(gs[name].abs().max() > 0)
    assert nonzero > 0, "all gradients are zero: the comparison would prove nothing"
    for name in stock_params:
        torch.testing.assert_close(fused_params[name], stock_params[name], rtol=1e-5, atol=1e-7)


def _peft_config(kind: str):
    peft = pytest.importorskip("peft")
    if kind == "lora":
        return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                               task_type="CAUSAL_LM")
    return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)


@pytest.mark.parametrize("kind", ["lora", "prompt_tuning"])
def test_peft_model_matches_stock(model_dir, tmp_path, fused_calls, kind):
    """A PEFT model (``peft_config``): LoRA (only its adapters train), and prompt tuning, whose virtual tokens the
    model prepends (the completion's hidden states are taken from the end, so they do not shift them); with a KL
    term, whose reference log-probs TRL computes with the adapter disabled. Same seed for the adapter's
    initialization in both runs. (An adapter on ``lm_head`` itself, whose effective weight is not ``lm_head.weight``,
    TRL refuses for every PEFT model, in the constructor the fused trainer shares.)"""
    config = _peft_config(kind)
    overrides = dict(loss_type="grpo", beta=0.04, num_iterations=2, epsilon=0.05)
    torch.manual_seed(0)
    stock = run(model_dir, trl.GRPOTrainer, tmp_path, trainer_kwargs=dict(peft_config=config), **overrides)
    assert not fused_calls
    torch.manual_seed(0)
    fused = run(model_dir, FusedGRPOTrainer, tmp_path, trainer_kwargs=dict(peft_config=config), **overrides)
    assert len(fused_calls) == 6
    assert_same_training(stock, fused)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_trainer_matches_stock(model_dir, tmp_path, fused_calls, case):
    overrides = CASES[case]
    stock = run(model_dir, trl.GRPOTrainer, tmp_path, **overrides)
    assert not fused_calls
    fused = run(model_dir, FusedGRPOTrainer, tmp_path, **overrides)
    # 3 optimizer steps x 2 accumulated micro-batches, each computed by fused_rl.
    assert len(fused_calls) == 6
    assert_same_training(stock, fused)


def test_patch_function_matches_stock(model_dir, tmp_path, fused_calls):
    overrides = dict(loss_type="dapo", beta=0.04, num_iterations=2, epsilon=0.05)
    stock = run(model_dir, trl.GRPOTrainer, tmp_path, **overrides)
    patched = run(model_dir, trl.GRPOTrainer, tmp_path, patch=True, **overrides)
    assert len(fused_calls) == 6
    assert_same_training(stock, patched)


@pytest.mark.parametrize("backend", ["reference", LINEAR_BACKEND])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])  # both normalizer branches, in eval mode
def test_eval_loss_matches_stock(model_dir, tmp_path, fused_calls, loss_type, backend):
    from datasets import Dataset

    results = []
    for cls in (trl.GRPOTrainer, FusedGRPOTrainer):
        kwargs = _trainer(model_dir, tmp_path, loss_type=loss_type, beta=0.04, use_bias_correction_kl=False,
                          per_device_eval_batch_size=4, seed=3)
        kwargs["eval_dataset"] = Dataset.from_dict({"prompt": ["abc", "hello"]})
        if cls is FusedGRPOTrainer:
            kwargs["fused_backend"] = backend
        results.append(cls(**kwargs).evaluate())
    assert fused_calls, "the fused loss was not used in evaluation"
    stock, fused = results
    for key in ("eval_loss", "eval_kl", "eval_entropy", "eval_clip_ratio/region_mean"):
        assert math.isclose(fused[key], stock[key], rel_tol=1e-5, abs_tol=1e-7), (key, fused[key], stock[key])


def test_clipping_is_exercised(model_dir, tmp_path):
    """The off-policy cases are only meaningful if some ratios leave the clip range."""
    logs, _, _ = run(model_dir, FusedGRPOTrainer, tmp_path, **CASES["dapo-beta0-iter2"])
    assert max(h.get("clip_ratio/region_mean", 0.0) for h in logs) > 0


def _trainer(model_dir, tmp_path, **overrides):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    kwargs = dict(output_dir=str(tmp_path / "unsupported"), use_cpu=True, report_to="none", bf16=False,
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=1,
                  save_strategy="no", disable_tqdm=True)
    kwargs.update(overrides)
    return dict(model=model_dir, reward_funcs=reward_fn, args=GRPOConfig(**kwargs),
                train_dataset=Dataset.from_dict({"prompt": ["abc", "hello"]}),
                processing_class=AutoTokenizer.from_pretrained(model_dir))


@pytest.mark.parametrize("overrides, needle", [
    (dict(loss_type="vespo", importance_sampling_level="sequence"), "loss_type='vespo'"),
    (dict(loss_type="sapo", importance_sampling_level="sequence"), "loss_type='sapo'"),
    (dict(entropy_coef=0.01), "entropy bonus"),
    (dict(loss_type="cispo", epsilon_high=5.0, importance_sampling_level="sequence"), "cispo"),
])
def test_unsupported_options_raise(model_dir, tmp_path, overrides, needle):
    with pytest.raises(NotImplementedError, match=needle.replace("(", r"\(")):
        FusedGRPOTrainer(**_trainer(model_dir, tmp_path, **overrides))


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_vllm_correction_without_bounds_is_unsupported(model_dir, tmp_path, mode):
    """TRL takes ``clip_min = clip_max = None`` (the unbounded ratio); fused_rl's rollout correction needs a bound:
    ``NotImplementedError`` naming both options (the ``ValueError`` named the mode, whose value is fine). vLLM is
    not installed here: the stock trainer is built without it and given TRL's vLLM attributes."""
    import trl

    trainer = trl.GRPOTrainer(**_trainer(model_dir, tmp_path))
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min = trainer.vllm_importance_sampling_clip_max = None
    with pytest.raises(NotImplementedError, match=rf"vllm_importance_sampling_clip_min=None and "
                                                  rf"vllm_importance_sampling_clip_max=None with "
                                                  rf"vllm_importance_sampling_mode='{mode}'"):
        patch_grpo_trainer(trainer, backend="torch")


def test_cispo_cap_below_one_raises(model_dir, tmp_path):
    with pytest.raises(ValueError, match="epsilon_high"):
        FusedGRPOTrainer(**_trainer(model_dir, tmp_path, loss_type="cispo", epsilon_high=0.2))


@pytest.mark.parametrize("overrides, needle", [
    (dict(epsilon=-0.1), r"^GRPOConfig.epsilon=-0.1 is outside what fused_rl computes: PolicyLossConfig.clip_low"),
    (dict(epsilon_high=-0.3), r"^GRPOConfig.epsilon_high=-0.3 is outside .*: PolicyLossConfig.clip_high must"),
    (dict(top_entropy_quantile=1.5), r"^GRPOConfig.top_entropy_quantile=1.5 is outside .*: PolicyLossConfig.top_"),
])
def test_out_of_range_options_name_the_grpo_config_option(model_dir, tmp_path, overrides, needle):
    """A value TRL takes but fused_rl's config refuses raises naming TRL's option (``epsilon``, Liger's
    ``epsilon_low``) and its value, with the field's own message."""
    trainer = trl.GRPOTrainer(**_trainer(model_dir, tmp_path))
    for name, value in overrides.items():  # after construction: TRL's own checks would refuse some at __init__
        setattr(trainer.args, name, value)
        setattr(trainer, name if name != "epsilon" else "epsilon_low", value)
    with pytest.raises(ValueError, match=needle):
        patch_grpo_trainer(trainer, backend="torch")


def test_supported_trainer_has_no_unsupported_options(model_dir, tmp_path):
    trainer = trl.GRPOTrainer(**_trainer(model_dir, tmp_path, loss_type="dapo", beta=0.04,
                                         use_bias_correction_kl=False))
    assert unsupported_options(trainer) == []


@pytest.mark.parametrize("case, option", [("off-policy-mask-iter2", "off_policy_mask_threshold"),
                                          ("grpo-mask-truncated-iter2", "mask_truncated_completions")])
def test_new_option_cases_are_exercised(model_dir, tmp_path, case, option):
    """The parity cases of an option prove something only if the option changes TRL's own training.
    (``delta-iter2`` does not: on this tiny model no negative-advantage ratio exceeds ``delta``, so
    the two-sided clip is covered by ``test_loss_math``'s scalar derivation instead.)"""
    with_option, _, _ = run(model_dir, trl.GRPOTrainer, tmp_path / "with", **CASES[case])
    without = {k: v for k, v in CASES[case].items() if k != option}
    without_option, _, _ = run(model_dir, trl.GRPOTrainer, tmp_path / "without", **without)
    assert any(not math.isclose(a["loss"], b["loss"], rel_tol=1e-6) for a, b in zip(with_option, without_option))


#: The entropies of a simulated second process (this model's are at most log(33) = 3.50).
OTHER_PROCESS_ENTROPIES = torch.linspace(3.30, 3.50, 41)


def _with_other_process(fn, calls: list):
    """``fn(trainer, ...)`` during which ``trainer.accelerator.gather`` also returns a second process's
    entropies (appended to what it gathers), as the gather of several processes would."""
    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        accelerator = self.accelerator
        real = accelerator.gather
        accelerator.gather = lambda t: torch.cat([real(t), OTHER_PROCESS_ENTROPIES.to(t)])
        calls.append(fn.__name__)
        try:
            return fn(self, *args, **kwargs)
        finally:
            del accelerator.gather
    return wrapped


def test_top_entropy_threshold_over_processes_matches_stock(model_dir, tmp_path, fused_calls, monkeypatch):
    """With several processes TRL takes ``top_entropy_quantile``'s threshold over every process's
    entropies (``get_high_entropy_mask``: pad across processes, gather). Simulated in one process: the
    gather in TRL's function and in fused_rl's ``_gather_entropies`` alike appends a second process's
    (high) entropies, which moves the threshold; both trainers must still train identically, and
    differently from one process (so the simulated process matters)."""
    import fused_rl.integrations.trl as integration

    overrides = CASES["top-entropy"]
    alone = run(model_dir, trl.GRPOTrainer, tmp_path / "alone", **overrides)
    calls = []
    monkeypatch.setattr(trl.GRPOTrainer, "get_high_entropy_mask",
                        _with_other_process(trl.GRPOTrainer.get_high_entropy_mask, calls))
    monkeypatch.setattr(integration, "_gather_entropies", _with_other_process(integration._gather_entropies, calls))
    stock = run(model_dir, trl.GRPOTrainer, tmp_path / "stock", **overrides)
    fused = run(model_dir, FusedGRPOTrainer, tmp_path / "fused", **overrides)
    assert calls.count("get_high_entropy_mask") == 6 and calls.count("_gather_entropies") == 6
    assert len(fused_calls) == 6
    assert_same_training(stock, fused)
    assert any(not math.isclose(a["loss"], b["loss"], rel_tol=1e-6) for a, b in zip(stock[0], alone[0]))


def test_old_logprobs_are_the_loss_head_s_under_bf16_autocast(model_dir, tmp_path, monkeypatch):
    """GRPOConfig's default ``bf16=True`` (fp32 weights, bf16 autocast): TRL's own head rounds the logits to bf16,
    so its old log-probs against fused_rl's fp32-head current ones gave an on-policy step ratios off 1 by ~4e-4
    (here) and clipped a sequence in four at GSPO's 3e-4 / 4e-4. The adapter computes TRL's log-prob passes with
    the loss's head: ratio 1 to fp32 rounding, nothing clipped, and the old log-probs within bf16 noise of TRL's."""
    import fused_rl.integrations.trl as integration

    trainer = FusedGRPOTrainer(**_trainer(model_dir, tmp_path, bf16=True, importance_sampling_level="sequence",
                                          epsilon=3e-4, epsilon_high=4e-4), fused_backend=LINEAR_BACKEND)
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(0)
    batch, prompt_len, completion_len = 4, 3, 6
    completion_mask = (torch.arange(completion_len)[None] < torch.tensor([[6], [2], [4], [1]])).long()
    inputs = dict(prompt_ids=torch.randint(3, 30, (batch, prompt_len), generator=g),
                  prompt_mask=torch.ones(batch, prompt_len, dtype=torch.long), completion_mask=completion_mask,
                  completion_ids=torch.randint(3, 30, (batch, completion_len), generator=g) * completion_mask,
                  advantages=torch.tensor([1.0, -0.5, 0.7, -1.2]), num_items_in_batch=completion_mask.sum().float())
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], completion_mask], 1)
    model = trainer.model
    with torch.no_grad():
        old, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attention, completion_len)
        logprob_pass = model._fused_rl_logprob_pass
        del model._fused_rl_logprob_pass  # TRL's own head, for comparison
        trl_old, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attention, completion_len)
        model._fused_rl_logprob_pass = logprob_pass
    on = completion_mask.bool()
    assert (old - trl_old)[on].abs().max() < 1e-2  # the same quantity, TRL's rounded to bf16 logits
    assert (old - trl_old)[on].abs().max() > 1e-5  # ... which this test needs to be meaningful
    captured = []
    original = integration.linear_policy_loss

    def capture(*args, **kwargs):
        captured.append(original(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(integration, "linear_policy_loss", capture)
    model.train()
    trainer._compute_loss(model, dict(inputs, old_per_token_logps=old))
    assert (captured[0].logprobs - old)[on].abs().max() < 1e-5
    metrics = trainer._metrics["train"]
    assert metrics["clip_ratio/region_mean"][-1] == 0.0 and metrics["clip_ratio/high_max"][-1] == 0.0


def _vllm_batch(trainer, lengths, g, tool_mask=None, accumulation=1):
    """``(inputs, completion_mask, logp)``: four prompts of 3 tokens and completions of ``lengths`` (of 6) drawn
    from ``g``, advantages ``[-1, 0.5, -0.3, 0.8]``, ``num_items_in_batch`` the loss tokens (``tool_mask`` applied)
    times the ``accumulation`` steps, and the model's per-token log-probs of the completions."""
    completion_mask = (torch.arange(6)[None] < torch.tensor(lengths)[:, None]).long()
    inputs = dict(prompt_ids=torch.randint(3, 30, (4, 3), generator=g), prompt_mask=torch.ones(4, 3, dtype=torch.long),
                  completion_ids=torch.randint(3, 30, (4, 6), generator=g) * completion_mask,
                  completion_mask=completion_mask, advantages=torch.tensor([-1.0, 0.5, -0.3, 0.8]))
    loss_tokens = completion_mask if tool_mask is None else completion_mask * tool_mask
    if tool_mask is not None:
        inputs["tool_mask"] = tool_mask
    inputs["num_items_in_batch"] = loss_tokens.sum().float() * accumulation
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], completion_mask], 1), 6)
    return inputs, completion_mask, logp


def _trl_is_ratio(trainer, old, sampling, mask):
    """TRL's ``importance_sampling_ratio`` (``_generate_and_score_completions``; NaN sampling log-probs give a
    log-ratio 0)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if trainer.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    lo, hi = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if trainer.vllm_importance_sampling_mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    return ratio.masked_fill((ratio < (lo if lo is not None else -math.inf)) | (ratio > hi), 0.0)


def _stock_and_fused(trainer, inputs):
    """``[(loss, grads)]`` of stock ``_compute_loss`` and of the patched trainer's on the same inputs."""
    model = trainer.model
    model.train()
    results = []
    for compute in (functools.partial(trl.GRPOTrainer._compute_loss, trainer), trainer._compute_loss):
        model.zero_grad()
        loss = compute(model, inputs)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    return results


@pytest.mark.parametrize("loss_type", ["dapo", "vespo"])
@pytest.mark.parametrize("correction", [True, False], ids=["is-correction", "no-correction"])
def test_unscored_vllm_tokens_match_stock(model_dir, tmp_path, correction, loss_type):
    """vLLM marks tokens it could not score with NaN sampling log-probs; TRL gives them log-ratio 0 in its
    importance ratio and in the off-policy mask's KL (``nan_to_num``). Stock ``_compute_loss`` (TRL's loss math, on
    the patched model's log-probs) and the adapter's on the same inputs, the NaN at a token where the old policy
    moved away from the current (so a substitute old log-prob would add its gap to the KL and drop the sequence);
    without the correction TRL passes no old log-probs (on-policy), where the adapter raised. vespo takes the
    correction inside its sequence weight (log-space), as TRL does."""
    trainer = trl.GRPOTrainer(**_trainer(model_dir, tmp_path, loss_type=loss_type, beta=0.0))
    trainer.current_gradient_accumulation_steps = 1
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, correction
    trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_max = "token_truncate", 3.0
    trainer.off_policy_mask_threshold = 0.1
    patch_grpo_trainer(trainer, backend=LINEAR_BACKEND)
    g = torch.Generator().manual_seed(0)
    inputs, completion_mask, logp = _vllm_batch(trainer, [6, 2, 4, 1], g)
    sampling = (logp + 0.05 * torch.randn(logp.shape, generator=g)).clamp(max=0.0) * completion_mask
    sampling[0, 1] = float("nan")  # unscored, in the A < 0 sequence 0
    if correction:
        old = logp.clone()
        old[0, 1] += 2.0  # the policy moved on this token since generation (num_iterations > 1)
        inputs.update(old_per_token_logps=old, importance_sampling_ratio=_trl_is_ratio(trainer, old, sampling,
                                                                                       completion_mask))
    inputs["sampling_per_token_logps"] = sampling
    (stock, stock_grads), (fused, fused_grads) = _stock_and_fused(trainer, inputs)
    torch.testing.assert_close(fused, stock, rtol=1e-5, atol=1e-7)
    assert len(fused_grads) == len(stock_grads)
    assert max(_rel_err(a, b) for a, b in zip(fused_grads, stock_grads)) < 1e-4


def test_log_prob_pass_of_an_all_masked_chunk(model_dir, tmp_path):
    """TRL scores log-probs in chunks of the per-device batch; with ``mask_truncated_completions`` a chunk of only
    truncated completions has no scored token: zeros, as TRL's own head gives (the adapter's pass raised on the
    empty gather), and a partly masked chunk equals TRL's head to bf16-free rounding."""
    trainer = FusedGRPOTrainer(**_trainer(model_dir, tmp_path), fused_backend=LINEAR_BACKEND)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 30, (2, 9), generator=g)
    model = trainer.model
    for completion_mask in (torch.zeros(2, 6, dtype=torch.long), torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0]])):
        attention = torch.cat([torch.ones(2, 3, dtype=torch.long), completion_mask], 1)
        outputs = []
        with torch.no_grad():
            for fused in (True, False):
                logprob_pass = model._fused_rl_logprob_pass
                if not fused:
                    del model._fused_rl_logprob_pass  # TRL's own head
                try:
                    outputs.append(trainer._get_per_token_logps_and_entropies(model, ids, attention, 6,
                                                                              compute_entropy=True)[:2])
                finally:
                    model._fused_rl_logprob_pass = logprob_pass
        (logp, entropy), (trl_logp, trl_entropy) = outputs
        torch.testing.assert_close(logp, trl_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy, trl_entropy, atol=1e-5, rtol=1e-5)
        assert (logp[completion_mask == 0] == 0).all()


#: Loss types (GRPOConfig overrides) for the vLLM-correction parity test; vespo takes token modes only (TRL raises).
VLLM_IS_LOSSES = {
    "grpo": dict(loss_type="grpo"), "dr_grpo": dict(loss_type="dr_grpo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.3),
    "sapo": dict(loss_type="sapo"), "vespo": dict(loss_type="vespo"),
    "luspo-seq": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.01),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.01),
}


@pytest.mark.parametrize("masks", [True, False], ids=["masks", "plain"])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss", sorted(VLLM_IS_LOSSES))
def test_vllm_correction_modes_match_stock(model_dir, tmp_path, loss, mode, masks):
    """Every ``vllm_importance_sampling_mode`` (TRL's default is ``sequence_mask``) with both bounds, for each loss
    family, with ``beta`` (the KL term is not corrected), a ``tool_mask`` and an empty completion, and (``masks``)
    what else reads the sampler's log-probs or the mask: ``off_policy_mask_threshold``, ``top_entropy_quantile``;
    without them the token-level losses run the tiled single pass (the sequence modes folded into the advantages).
    Stock ``_compute_loss`` and the adapter's on the same inputs: loss, gradients and every logged metric."""
    if loss == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL refuses a sequence-level vLLM correction with vespo")
    extra = dict(top_entropy_quantile=0.6, off_policy_mask_threshold=0.05) if masks else {}
    trainer = trl.GRPOTrainer(**_trainer(model_dir, tmp_path, beta=0.05, **extra, **VLLM_IS_LOSSES[loss]))
    trainer.current_gradient_accumulation_steps = 2
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = 0.8, 1.2
    patch_grpo_trainer(trainer, backend=LINEAR_BACKEND)
    g = torch.Generator().manual_seed(0)
    tool_mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1] * 6, [0, 1, 1, 1, 1, 1], [1] * 6])
    inputs, completion_mask, logp = _vllm_batch(trainer, [6, 0, 4, 3], g, tool_mask=tool_mask, accumulation=2)
    model = trainer.model
    sampling = (logp + 0.3 * torch.randn(logp.shape, generator=g)).clamp(max=0.0) * completion_mask
    sampling[0, 1] = float("nan")
    old = logp + 0.2 * torch.randn(logp.shape, generator=g) * completion_mask
    inputs.update(old_per_token_logps=old, sampling_per_token_logps=sampling,
                  importance_sampling_ratio=_trl_is_ratio(trainer, old, sampling, completion_mask * tool_mask),
                  ref_per_token_logps=logp + 0.3 * torch.randn(logp.shape, generator=g))
    model.train()
    results = []
    for compute in (functools.partial(trl.GRPOTrainer._compute_loss, trainer), trainer._compute_loss):
        model.zero_grad()
        trainer._metrics["train"].clear()
        loss_value = compute(model, inputs)
        loss_value.backward()
        results.append((loss_value.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None],
                        {k: v[-1] for k, v in trainer._metrics["train"].items()}))
    (stock, stock_grads, stock_metrics), (fused, fused_grads, fused_metrics) = results
    torch.testing.assert_close(fused, stock, rtol=1e-5, atol=1e-7)
    assert len(fused_grads) == len(stock_grads)
    assert max(_rel_err(a, b) for a, b in zip(fused_grads, stock_grads)) < 1e-4
    assert fused_metrics.keys() == stock_metrics.keys()
    for key, value in stock_metrics.items():
        assert math.isclose(fused_metrics[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, fused_metrics[key], value)


@pytest.mark.parametrize("overrides, needle", [
    (dict(use_adaptive_entropy=True), "entropy bonus"),
    (dict(delta=1.1), "delta"),  # <= 1 + epsilon_high: TRL accepts it, fused_rl's two-sided clip does not
])
def test_more_unsupported_options_raise(model_dir, tmp_path, overrides, needle):
    with pytest.raises(NotImplementedError, match=needle):
        FusedGRPOTrainer(**_trainer(model_dir, tmp_path, **overrides))


@pytest.mark.parametrize("overrides, needle", [
    (dict(epsilon=-0.1), r"GRPOConfig\.epsilon=-0\.1"),
    (dict(epsilon_high=-0.1), r"GRPOConfig\.epsilon_high=-0\.1"),
    (dict(off_policy_mask_threshold=-0.5), r"GRPOConfig\.off_policy_mask_threshold=-0\.5"),
    (dict(loss_type="vespo", vespo_lambda_neg=-1.0), r"GRPOConfig\.vespo_lambda_neg=-1\.0"),
    (dict(beta=-0.1), r"GRPOConfig\.beta=-0\.1"),  # a PolicyLossConfig field of the same name
    (dict(loss_type="sapo", delta=2.0), r"^delta .* not loss_type='sapo'"),  # checked under TRL's names
])
def test_out_of_range_options_name_the_trl_option(model_dir, tmp_path, overrides, needle):
    """A TRL option fused_rl refuses as out of range raises ``ValueError`` naming the GRPOConfig option and its
    value (not only the ``PolicyLossConfig`` field it maps to, e.g. ``clip_low`` for ``epsilon``)."""
    with pytest.raises(ValueError, match=needle):
        FusedGRPOTrainer(**_trainer(model_dir, tmp_path, **overrides))


def _tiny_model(kind: str):
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM, MixtralConfig,
                              MixtralForCausalLM)

    common = dict(vocab_size=len(CHARS) + 6, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                  eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    if kind == "moe":
        return MixtralForCausalLM(MixtralConfig(num_local_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.01,
                                                **common))
    if kind == "softcapping":
        return Gemma2ForCausalLM(Gemma2Config(head_dim=8, final_logit_softcapping=30.0, **common))
    return GraniteForCausalLM(GraniteConfig(logits_scaling=8.0, **common))


@pytest.mark.parametrize("kind, needle", [("moe", "router_aux_loss_coef"), ("softcapping", "final_logit_softcapping"),
                                          ("scaling", "logits_scaling")])
def test_unsupported_models_raise(model_dir, tmp_path, kind, needle):
    """Models whose TRL loss or head fused_rl does not compute (MoE router auxiliary loss; logits soft-capped or
    scaled after the head) are refused at construction, naming what."""
    kwargs = _trainer(model_dir, tmp_path)
    kwargs["model"] = _tiny_model(kind)
    with pytest.raises(NotImplementedError, match=needle):
        FusedGRPOTrainer(**kwargs)


@pytest.mark.parametrize("changes", [dict(beta=0.2), dict(beta=0.0), dict(epsilon_high=0.3),
                                     dict(loss_type="dapo"), dict(off_policy_mask_threshold=0.0)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_options_changed_after_construction_take_effect(model_dir, tmp_path, changes):
    """TRL reads ``beta``, ``epsilon_high``, ``loss_type``, ... at every step (a KL or clip schedule in a callback
    sets them): the adapter's loss follows, as its metrics did (it built its config once and kept the old ones)."""
    trainer = trl.GRPOTrainer(**_trainer(model_dir, tmp_path, loss_type="grpo", beta=0.04, epsilon=0.05))
    trainer.current_gradient_accumulation_steps = 2
    patch_grpo_trainer(trainer, backend=LINEAR_BACKEND)
    g = torch.Generator().manual_seed(0)
    inputs, completion_mask, logp = _vllm_batch(trainer, [6, 2, 4, 1], g, accumulation=2)
    inputs["advantages"] = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    inputs["old_per_token_logps"] = (logp + 0.4 * torch.randn(logp.shape, generator=g)) * completion_mask
    inputs["ref_per_token_logps"] = (logp + 0.3 * torch.randn(logp.shape, generator=g)) * completion_mask
    for name, value in changes.items():
        setattr(trainer, name, value)
    (stock, stock_grads), (fused, fused_grads) = _stock_and_fused(trainer, inputs)
    torch.testing.assert_close(fused, stock, rtol=1e-5, atol=1e-7)
    assert max(_rel_err(a, b) for a, b in zip(fused_grads, stock_grads)) < 1e-4


def test_advantages_of_shape_b_1_broadcast_as_in_trl(model_dir, tmp_path):
    trainer = trl.GRPOTrainer(**_trainer(model_dir, tmp_path, loss_type="grpo", beta=0.0))
    trainer.current_gradient_accumulation_steps = 1
    patch_grpo_trainer(trainer, backend=LINEAR_BACKEND)
    inputs, completion_mask, logp = _vllm_batch(trainer, [6, 2, 4, 1], torch.Generator().manual_seed(0))
    inputs["advantages"] = inputs["advantages"][:, None]
    (stock, _), (fused, _) = _stock_and_fused(trainer, inputs)
    torch.testing.assert_close(fused, stock, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("hook", ["_compute_loss", "get_off_policy_mask", "get_high_entropy_mask"])
@pytest.mark.parametrize("entry", ["patch", "subclass"])
def test_a_subclass_s_own_loss_hooks_are_refused(model_dir, tmp_path, hook, entry):
    """The fused loss computes what TRL's ``_compute_loss`` and its hooks do; a subclass's own version (TRL's
    ``trl.experimental.gmpo.GMPOTrainer._compute_loss``) would silently not run, and trained the stock loss. A
    ``FusedGRPOTrainer`` subclass may override ``_compute_loss``: it chose its own loss."""
    base = trl.GRPOTrainer if entry == "patch" else FusedGRPOTrainer
    own = type("OwnHooks", (base,), {hook: lambda self, *args, **kwargs: getattr(base, hook)(self, *args, **kwargs)})
    make = (lambda: patch_grpo_trainer(own(**_trainer(model_dir, tmp_path)))) if entry == "patch" else \
        (lambda: own(**_trainer(model_dir, tmp_path)))
    if entry == "subclass" and hook == "_compute_loss":
        assert not unsupported_options(make())
        return
    with pytest.raises(NotImplementedError, match=f"OwnHooks.{hook} overrides GRPOTrainer.{hook}"):
        make()


def test_deepspeed_zero3_is_refused(model_dir, tmp_path, monkeypatch):
    """ZeRO-3 shards ``lm_head.weight`` to an empty tensor outside the head's forward, and the adapter reads it
    directly (TRL gathers it for its fused head): refused at construction rather than a shape error at step 1."""
    import transformers.integrations.deepspeed as hf_deepspeed

    trainer = trl.GRPOTrainer(**_trainer(model_dir, tmp_path))
    assert not unsupported_options(trainer)
    monkeypatch.setattr(hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(NotImplementedError, match="DeepSpeed ZeRO-3"):
        patch_grpo_trainer(trainer)


def test_dapo_num_items_in_batch_is_clamped_at_one(model_dir, tmp_path):
    """dapo's normalizer is ``max(num_items_in_batch, 1) / num_processes`` (module doc): 0.5 divides as 1."""
    trainer = FusedGRPOTrainer(**_trainer(model_dir, tmp_path, loss_type="dapo", beta=0.0),
                               fused_backend=LINEAR_BACKEND)
    trainer.current_gradient_accumulation_steps = 1
    trainer.args.steps_per_generation = 1
    inputs, _, logp = _vllm_batch(trainer, [6, 2, 4, 1], torch.Generator().manual_seed(0))
    inputs["old_per_token_logps"] = logp - 0.1
    trainer.model.train()
    losses = [trainer._compute_loss(trainer.model, dict(inputs, num_items_in_batch=torch.tensor(n))).detach()
              for n in (0.5, 1.0)]
    assert losses[1].item() != 0.0
    torch.testing.assert_close(losses[0], losses[1])


def test_cispo_clip_ratio_counts_only_positive_advantages(model_dir, tmp_path):
    """TRL's ``cispo_clip_ratio``: tokens with ``r > epsilon_high`` and ``A > 0``. Every ratio is ``e`` (> 1.5) and
    the advantages ``(0, 0, 0, 1)``: only the last sequence's token counts (1 of the 13 loss tokens)."""
    trainer = FusedGRPOTrainer(**_trainer(model_dir, tmp_path, loss_type="cispo", beta=0.0, epsilon_high=1.5),
                               fused_backend=LINEAR_BACKEND)
    trainer.current_gradient_accumulation_steps = 1
    inputs, mask, logp = _vllm_batch(trainer, [6, 2, 4, 1], torch.Generator().manual_seed(0))
    inputs.update(old_per_token_logps=logp - 1.0, advantages=torch.tensor([0.0, 0.0, 0.0, 1.0]))
    trainer.model.train()
    trainer._compute_loss(trainer.model, inputs)
    assert trainer._metrics["train"]["cispo_clip_ratio"][-1] == pytest.approx(1 / 13)
