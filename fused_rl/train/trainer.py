"""The training loop: rollout -> rewards -> advantages -> ``num_iterations`` epochs of minibatch updates.

Loss scaling under gradient accumulation and DDP (``W`` processes, DDP *averages* gradients):

* ``agg="token-mean"`` (bnpo / dapo / ppo / cispo presets): every micro-batch uses
  ``token_normalizer = N`` = the number of loss tokens of the whole minibatch summed over all
  processes (an all-reduce), and its loss is multiplied by ``W``; summed over micro-batches and
  averaged by DDP this is ``sum(l * m) / N`` over the global minibatch, exactly.
* the per-sequence aggregations (grpo, dr_grpo, ...) average over sequences: a micro-batch of ``b`` of
  the minibatch's ``B`` local sequences is weighted ``b / B``; DDP's average over equal-sized local
  batches then gives the global sequence mean.

The per-process prompt batch is ``prompts_per_step``; the global batch is ``W`` times that.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from fused_rl import advantages as adv_lib
from fused_rl import loss_math

from . import checkpoint
from .config import SEED_LIMIT, ConfigError, TrainConfig, to_dict, yaml_dump
from .plot import read_metrics
from .models import DTYPES, PolicyModule, load_policy, resolve_linear_backend
from .rollout import Rollout, rollout
from .tasks import RewardFunctionError, make_task, resolve_reward

#: Loss metrics logged (token-weighted means) when the loss options that produce them are set.
OPTION_METRICS = ("rollout_is_mean", "rollout_is_clip_frac", "off_policy_mask_frac", "entropy_mask_frac",
                  "vespo_phi_mean", "cov_frac")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


#: Whether :func:`init_distributed` started the process group (so :func:`close_distributed` ends it; a group the
#: caller started is the caller's).
_STARTED_GROUP = False


def init_distributed(device_type: str) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (``WORLD_SIZE > 1``); gloo on CPU."""
    global _STARTED_GROUP
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        _STARTED_GROUP = True
    return _world()


def close_distributed() -> None:
    """Ends the process group :func:`init_distributed` started, once every process is done (a barrier), after the
    trainers are released (``fused-rl train`` and :func:`fused_rl.train.train` call it). Left to interpreter exit,
    the group was destroyed while a DDP wrapper still held it, in torch's teardown: the gloo threads then aborted
    the process ("terminate called without an active exception", a torchrun test once) or deadlocked on the GIL."""
    global _STARTED_GROUP
    if _STARTED_GROUP and dist.is_initialized():
        gc.collect()  # a released Trainer's DDP wrapper in reference cycles
        dist.barrier()
        dist.destroy_process_group()
    _STARTED_GROUP = False


def _all_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the processes (``x`` on the training device: NCCL reduces GPU tensors only)."""
    if _world()[1] > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


@contextlib.contextmanager
def _config_errors():
    """The ``ValueError`` of a bad task / model choice as a :class:`ConfigError` (the CLI's one-line error)."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def resolve_device(name: str) -> torch.device:
    """``"auto"``: this process's GPU when CUDA is available, else the CPU; ``"cuda"``: this process's GPU (the
    ``LOCAL_RANK``-th, or the one GPU it sees); a ``cuda[:N]`` that this machine lacks, or ``cuda:N`` under torchrun
    with several processes on a machine of several visible GPUs (all on GPU N), raises :class:`ConfigError`. A CUDA
    device becomes the current one."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"config field 'device' = {name!r}: CUDA is not available here (torch "
                              f"{torch.__version__}, CUDA build: {torch.version.cuda}); use 'cpu' or 'auto'")
        count, local_world = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if device.index is not None and local_world > 1 and count > 1:
            raise ConfigError(f"config field 'device' = {name!r} under torchrun would put this machine's "
                              f"{local_world} processes on GPU {device.index}: use 'cuda' or 'auto' (each process "
                              "its LOCAL_RANK's GPU)")
        # one visible GPU (a launcher giving each process its own): that one, whatever the local rank
        device = torch.device("cuda", device.index if device.index is not None else (local if count > 1 else 0))
        if device.index >= count:
            raise ConfigError(f"config field 'device' = {name!r}: this machine has {torch.cuda.device_count()} "
                              f"CUDA device(s), numbered from 0" + ("" if ":" in name else f" (LOCAL_RANK {local})"))
        torch.cuda.set_device(device)
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed % SEED_LIMIT)  # seed + 1000 * rank may pass torch's 2**64 - 1


def make_scheduler(optimizer, cfg: TrainConfig):
    """Linear warm-up over ``warmup_steps`` then cosine decay to ``min_lr_ratio * lr`` at ``steps``
    (``lr_schedule="constant"``: flat after warm-up); stepped once per training step."""
    warm, total, floor = cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Trainer:
    """Builds everything from a validated :class:`TrainConfig`; :meth:`train` runs the loop."""

    def __init__(self, cfg: TrainConfig, *, quiet: bool = False):
        self.cfg = cfg.validate()  # as load_config validates it: a TrainConfig built in code is not
        self.device = resolve_device(cfg.device)
        self.rank, self.world = init_distributed(self.device.type)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed + 1000 * self.rank)
        self.prompt_rng = random.Random(cfg.seed * 7919 + self.rank)
        self.quiet = quiet or self.rank != 0
        self.run_dir = Path(cfg.run_dir)
        with _config_errors():
            self.task = make_task(cfg.task, cfg.task_args)
        specs = cfg.rewards or list(self.task.default_rewards)
        self.reward_fns = [resolve_reward(s) for s in specs]
        self.reward_weights = [float(w) for w in cfg.reward_weights] or [1.0] * len(specs)
        names = [name for name, _ in self.reward_fns]
        if cfg.correct_reward and cfg.correct_reward not in names:
            raise ConfigError(f"config field 'correct_reward' = {cfg.correct_reward!r}: not one of the rewards {names}")
        if len(names) > 1 and cfg.kimi_length_coef > 0 and not cfg.correct_reward:
            raise ConfigError(f"config field 'kimi_length_coef' = {cfg.kimi_length_coef!r} with the rewards {names}: "
                              "set correct_reward to the one that says an answer is right (the weighted total would "
                              "count a wrong but well-formatted answer as correct and give it the length bonus)")
        self.loss_config = cfg.loss_config()
        self.advantage = cfg.resolved_advantage
        try:  # before the model loads (minutes for a real one); load_policy's weights are fp32 whatever cfg.dtype
            self.backend = resolve_linear_backend(cfg.backend, self.device, torch.float32)
        except (RuntimeError, ValueError) as exc:  # e.g. backend: triton / cuda on a CPU-only machine
            raise ConfigError(f"config field 'backend' = {cfg.backend!r}: {exc}") from exc
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        with _config_errors():
            lm, self.tokenizer = load_policy(cfg, self.task, self.device)
        self.policy = PolicyModule(lm, value_head=self.advantage == "gae",
                                   compute_dtype=DTYPES[cfg.dtype]).to(self.device)
        # no dropout (as TRL's disable_dropout): the old, reference and training log-probs must be one
        # function of the weights, or ratios differ from 1 before any update
        self.policy.eval()
        self.ref: Optional[PolicyModule] = None
        if self.loss_config.kl is not None:
            # the frozen start point's LM alone (a value head would be dead weight there)
            self.ref = PolicyModule(copy.deepcopy(self.policy.lm), compute_dtype=self.policy.compute_dtype)
            self.ref.eval().requires_grad_(False)
        seed_everything(cfg.seed + 1000 * self.rank)
        self.model = self.policy
        if self.world > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.policy, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        decay = [p for n, p in self.policy.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.policy.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=1e-8)
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.step = 0
        self._metrics_prepared = False
        self.resume_changes: dict = {}  # field -> (checkpoint's value, this config's) of a resumed run
        if cfg.resume:
            if not checkpoint.exists(self.run_dir):  # as HF's resume_from_checkpoint=True: never a silent restart
                raise ConfigError(f"resume: no checkpoint in run_dir {str(self.run_dir)!r} to resume from "
                                 "(check the path, or drop --resume to start a new run there)")
            # the reference model is the run's start point, rebuilt from these fields (not saved): the tiny model's
            # random init depends on the seed
            ref_fields: tuple = ()
            if self.ref is not None:
                ref_fields = ("model", "model_config", "seed") if cfg.model == "tiny" else ("model",)
            try:
                self.step, saved = checkpoint.load(self.run_dir, model=self.policy, optimizer=self.optimizer,
                                            scheduler=self.scheduler, prompt_rng=self.prompt_rng, rank=self.rank,
                                            world_size=self.world, map_location=self.device,
                                            fixed={name: getattr(cfg, name) for name in ref_fields})
            except checkpoint.CheckpointMismatch as exc:
                message, saved = exc.args
                changed = {k: (saved[k], v) for k, v in to_dict(cfg).items() if k in saved and saved[k] != v}
                changed.pop("resume", None)
                raise ConfigError(f"resume: the checkpoint in {str(self.run_dir)!r} does not fit this config's model "
                                  f"({message}); fields changed since it was written (checkpoint, now): "
                                  f"{changed}") from None
            except checkpoint.WorldSizeMismatch as exc:
                raise ConfigError(f"resume: {exc}") from None
            self._apply_optimizer_config()
            # said at the start of training: a resumed run takes this config, the loss's fields too
            self.resume_changes = {k: (saved[k], v) for k, v in to_dict(cfg).items() if k in saved
                                   and k not in ("resume", "run_dir") and not checkpoint.same(saved[k], v)}

    def _apply_optimizer_config(self) -> None:
        """After a resume: the checkpoint restored AdamW's moments and the schedule's position; ``lr``,
        ``weight_decay``, ``adam_betas`` and the schedule (``warmup_steps``, ``steps``, ...) are this config's,
        so a value changed for the resumed run applies from its first step (unchanged: the same numbers)."""
        cfg, sched = self.cfg, self.scheduler
        sched.base_lrs = [cfg.lr] * len(self.optimizer.param_groups)
        for group, decay, fn in zip(self.optimizer.param_groups, (cfg.weight_decay, 0.0), sched.lr_lambdas):
            group.update(initial_lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=decay,
                         lr=cfg.lr * fn(sched.last_epoch))

    # ------------------------------------------------------------------ rollout and advantages
    def collect(self, examples: Optional[list] = None) -> Rollout:
        cfg = self.cfg
        if examples is None:
            examples = self.task.sample(self.prompt_rng, cfg.prompts_per_step)
        with self.policy.autocast():
            return rollout(self.policy.lm, self.tokenizer, examples, self.reward_fns, self.reward_weights,
                           group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                           temperature=cfg.temperature, top_p=cfg.top_p, truncation=cfg.truncation,
                           truncation_penalty=cfg.truncation_penalty,
                           sampler_logprobs=self.loss_config.uses_rollout_logprobs, device=self.device)

    def _chunks(self, n: int):
        size = self.cfg.resolved_micro
        for start in range(0, n, size):
            yield torch.arange(start, min(n, start + size), device=self.device)

    @torch.no_grad()
    def _logprobs(self, module: PolicyModule, batch: Rollout, with_values: bool = False):
        logps, values = [], []
        for idx in self._chunks(batch.targets.shape[0]):
            lp, v = module.token_logprobs(batch.input_ids[idx], batch.attention_mask[idx], batch.position_ids[idx],
                                          batch.prompt_len, batch.targets[idx], batch.mask[idx],
                                          self.loss_config.temperature, backend=self.backend,
                                          with_values=with_values)
            logps.append(lp)
            values.append(v)
        return torch.cat(logps), (torch.cat(values) if with_values else None)

    def _trained_mask(self, mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """The loss tokens: ``mask`` without the truncated rows when the loss option
        ``mask_truncated_completions`` drops them (``truncation: mask`` has dropped them from ``mask`` already)."""
        return mask & ~truncated.unsqueeze(1) if self.loss_config.mask_truncated_completions else mask

    def _correct(self, batch: Rollout) -> torch.Tensor:
        """``(N,)`` bool on the rewards' device: the completions whose reward is ``>= correct_threshold``, the
        weighted total or ``correct_reward``'s own value (a truncated completion under ``truncation: penalize`` takes
        the penalty, as the total does)."""
        cfg = self.cfg
        values = batch.rewards
        if cfg.correct_reward:
            values = batch.reward_parts[cfg.correct_reward].to(batch.rewards.device, batch.rewards.dtype)
            if cfg.truncation == "penalize":
                values = torch.where(batch.truncated.to(values.device), cfg.truncation_penalty, values)
        return values >= cfg.correct_threshold

    def advantages(self, batch: Rollout, values: Optional[torch.Tensor]):
        """``(advantages (N,) or (N, T), returns or None)`` from the rollout's rewards."""
        cfg, G = self.cfg, self.cfg.group_size
        rewards = batch.rewards.float()
        if cfg.kimi_length_coef > 0 and self.step >= cfg.kimi_length_warmup_steps:  # self.step: steps done
            correct = self._correct(batch)
            length = adv_lib.kimi_length_reward(batch.lengths, correct, G).to(rewards.device)
            rewards = rewards + cfg.kimi_length_coef * length
            if not torch.isfinite(rewards).all():  # as score() checks the weighted reward sum
                raise RewardFunctionError(
                    f"the rewards (max |reward| {float(batch.rewards.abs().max()):.4g}) plus kimi_length_coef = "
                    f"{cfg.kimi_length_coef:g} times the Kimi length reward (in [-0.5, 0.5]) overflow float32")
        if self.advantage == "grpo":
            return adv_lib.grpo(rewards, G), None
        if self.advantage == "dr_grpo":
            return adv_lib.grpo(rewards, G, scale=False), None
        if self.advantage == "rloo":
            return adv_lib.rloo(rewards, G), None
        # PPO: the sequence reward on the last loss token, GAE over the value head's estimates; the rows the
        # loss drops (mask_truncated_completions) take no part, as with truncation: mask
        mask = self._trained_mask(batch.mask, batch.truncated)
        last = (mask.long().cumsum(1) == mask.long().sum(1, keepdim=True)) & mask
        token_rewards = torch.where(last, rewards.unsqueeze(1), torch.zeros_like(values))
        # every process stops together (one alone would leave the others in the next all-reduce)
        if _all_sum((~torch.isfinite(torch.where(mask, values, torch.zeros_like(values)))).sum().float()) > 0:
            raise FloatingPointError(f"step {self.step + 1}: the value head's estimates are not finite: it diverged; "
                                     "lower lr or vf_coef, or scale the rewards down")
        adv, returns = adv_lib.gae(token_rewards, values, mask, gamma=cfg.gamma, lam=cfg.lam)
        # the whitening's sums in float64: advantages of no spread then have exactly their mean and whiten to 0 (float32
        # sums put the mean an ulp off, var 0, and the ulp / 1e-8 made advantages of 47 on every token)
        m, a = mask.double(), adv.double()
        stats = _all_sum(torch.stack([(a * m).sum(), (a * a * m).sum(), m.sum()]))
        mean = stats[0] / stats[2].clamp(min=1)
        var = (stats[1] / stats[2].clamp(min=1) - mean ** 2).clamp(min=0)
        adv = torch.where(mask, ((a - mean) / (var.sqrt() + 1e-8)).to(adv.dtype), torch.zeros_like(adv))
        return adv, returns

    # ------------------------------------------------------------------ optimisation
    def _on_policy_update(self, n: int) -> bool:
        """Whether this process's ``n`` rollout sequences get one update (one iteration, one minibatch) without a
        value head: the loss is then on-policy and takes ``old = sg(logp)`` itself (ratio exactly 1, as TRL's), with
        no pass for the old log-probs."""
        return self.cfg.num_iterations == 1 and self.cfg.resolved_minibatch >= n and self.advantage != "gae"

    def update(self, batch: Rollout) -> dict:
        """All optimizer steps of one training step on ``batch`` (this process's share); returns metrics."""
        cfg = self.cfg
        n = batch.targets.shape[0]
        mb = cfg.resolved_minibatch
        old = values = None
        if not self._on_policy_update(n):
            old, values = self._logprobs(self.policy, batch, with_values=self.advantage == "gae")
        ref = self._logprobs(self.ref, batch)[0] if self.ref is not None else None
        advantages, returns = self.advantages(batch, values)
        token_mean = self.loss_config.agg == "token-mean"
        per_sequence_clip = loss_math.clip_fractions_per_sequence(self.loss_config)
        sums: dict[str, torch.Tensor] = {}
        grad_norms = []
        perm_gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + self.step * 101 + self.rank) % SEED_LIMIT)
        for _ in range(cfg.num_iterations):
            order = (torch.randperm(n, generator=perm_gen).to(self.device) if mb < n
                     else torch.arange(n, device=self.device))
            for start in range(0, n, mb):
                mb_idx = order[start:start + mb]
                # token-mean's normalizer and the value loss's: the minibatch's loss tokens over all processes
                # (without truncated rows when the loss drops them)
                normalizer = value_tokens = None
                loss_mask = self._trained_mask(batch.mask[mb_idx], batch.truncated[mb_idx])
                if token_mean:
                    normalizer = _all_sum(loss_mask.sum().float()).clamp(min=1.0)
                if returns is not None:
                    value_tokens = _all_sum(loss_mask.sum().float()).clamp(min=1.0)
                micros = [mb_idx[i:i + cfg.resolved_micro] for i in range(0, len(mb_idx), cfg.resolved_micro)]
                self.optimizer.zero_grad(set_to_none=True)
                for k, idx in enumerate(micros):
                    sync = k == len(micros) - 1
                    ctx = self.model.no_sync() if (self.world > 1 and not sync) else contextlib.nullcontext()
                    with ctx:
                        out, value = self.model(
                            batch.input_ids[idx], batch.attention_mask[idx], batch.position_ids[idx],
                            batch.prompt_len, batch.targets[idx], advantages[idx], batch.mask[idx],
                            old_logprobs=None if old is None else old[idx],
                            ref_logprobs=None if ref is None else ref[idx],
                            rollout_logprobs=None if batch.sampler_logprobs is None else batch.sampler_logprobs[idx],
                            truncated=batch.truncated[idx] if self.loss_config.mask_truncated_completions else None,
                            loss_config=self.loss_config, token_normalizer=normalizer, backend=self.backend,
                            returns=None if returns is None else returns[idx], value_normalizer=value_tokens,
                            old_values=None if values is None else values[idx], value_clip=cfg.value_clip)
                        share = len(idx) / len(mb_idx)
                        loss = out.loss * (self.world if token_mean else share)
                        # summed over micro-batches and processes this is the minibatch's policy loss
                        sums["loss"] = sums.get("loss", 0.0) + loss.detach().float() / self.world
                        if value is not None:  # a sum over the micro-batch / the minibatch's tokens
                            value_loss, value_clipped = value
                            loss = loss + cfg.vf_coef * value_loss * self.world
                            sums["value_loss"] = sums.get("value_loss", 0.0) + value_loss.detach().float()
                            if value_clipped is not None:
                                sums["value_clip_frac"] = sums.get("value_clip_frac", 0.0) + value_clipped
                        loss.backward()
                    tokens = self._trained_mask(batch.mask[idx], batch.truncated[idx]).sum().float()
                    rows = torch.tensor(float(len(idx)), device=tokens.device)
                    for key, name in (("kl", "kl_mean"), ("clip_frac", "clip_frac"), ("entropy", "entropy_mean"),
                                      *((k, k) for k in OPTION_METRICS)):
                        if name in out.metrics and (key != "kl" or ref is not None):
                            weight = rows if key == "clip_frac" and per_sequence_clip else tokens
                            sums[key] = sums.get(key, 0.0) + out.metrics[name].detach().float() * weight
                    sums["tokens"] = sums.get("tokens", 0.0) + tokens
                    sums["rows"] = sums.get("rows", 0.0) + rows
                if cfg.max_grad_norm > 0:
                    gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
                else:
                    gn = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in self.policy.parameters()
                                        if p.grad is not None))
                if not torch.isfinite(gn):  # clip_grad_norm_ would scale every gradient to 0 (or NaN): no update
                    raise FloatingPointError(
                        f"step {self.step + 1}: the gradient norm is {float(gn)}: the loss or its gradient overflowed "
                        f"and no update was applied. Rewards up to |{float(batch.rewards.abs().max()):.4g}| enter "
                        f"the loss at their scale with advantage {self.advantage!r} (grpo divides it by the group's "
                        "std): scale the rewards down; or the policy diverged: lower lr")
                grad_norms.append(gn.detach().float())
                self.optimizer.step()
        n_updates = len(grad_norms)
        tokens, rows = sums.pop("tokens"), sums.pop("rows")
        keys = [k for k in ("kl", "clip_frac", "entropy", *OPTION_METRICS, "value_clip_frac") if k in sums]
        # the value loss: each process holds its share of the minibatches' global token means
        value_loss = [sums["value_loss"] / n_updates] if "value_loss" in sums else []
        local = torch.stack([sums[k] for k in keys] + [sums["loss"] / n_updates, tokens,
                             batch.rewards.float().sum(), (batch.rewards.float() ** 2).sum(),
                             self._correct(batch).float().sum(),
                             batch.lengths.float().sum(), batch.truncated.float().sum(),
                             torch.tensor(float(n), device=batch.rewards.device), rows] + value_loss)
        tot = _all_sum(local.to(self.device).double())
        k = len(keys)
        count = tot[k + 7]
        # token means, but gspo's clip fraction a mean over the sequences (every iteration's, every process's)
        metrics = {key: float(tot[i] / tot[k + 8 if key == "clip_frac" and per_sequence_clip else k + 1].clamp(min=1))
                   for i, key in enumerate(keys)}
        mean_r = float(tot[k + 2] / count)
        metrics.update(loss=float(tot[k]), reward=mean_r,
                       reward_std=math.sqrt(max(0.0, float(tot[k + 3] / count) - mean_r ** 2)),
                       accuracy=float(tot[k + 4] / count), length=float(tot[k + 5] / count),
                       truncated=float(tot[k + 6] / count), grad_norm=float(torch.stack(grad_norms).mean()),
                       lr=self.optimizer.param_groups[0]["lr"])
        if value_loss:
            metrics["value_loss"] = float(tot[k + 9])
        return metrics

    # ------------------------------------------------------------------ loop
    def train_step(self) -> dict:
        t0 = time.perf_counter()
        batch = self.collect()
        metrics = self.update(batch)
        self.scheduler.step()
        self.step += 1
        dt = time.perf_counter() - t0
        gen_tokens = float(_all_sum(batch.lengths.sum().to(self.device, torch.float64)))
        metrics.update(step=self.step, tokens_per_s=gen_tokens / dt, step_time=dt)
        return metrics

    @torch.no_grad()
    def evaluate(self, n: Optional[int] = None) -> dict:
        """Greedy reward and accuracy on ``n`` (None: ``eval_prompts``) of the task's held-out prompts. Under DDP
        every process generates its share (prompts ``rank::world``) and the sums of reward, correct answers and
        prompts are all-reduced, so all processes must call it together and none waits in a collective while another
        evaluates; ``samples`` are this process's first four."""
        n = self.cfg.eval_prompts if n is None else n
        if n < 1:
            raise ValueError(f"evaluate: the number of prompts must be >= 1, got {n}")
        examples = self.task.heldout(n)[self.rank::self.world]
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # reward, correct, prompts
        samples: list = []
        if examples:  # fewer held-out prompts than processes leave some without any
            with self.policy.autocast():
                batch = rollout(self.policy.lm, self.tokenizer, examples, self.reward_fns, self.reward_weights,
                                group_size=1, max_new_tokens=self.cfg.max_new_tokens, temperature=1.0, top_p=1.0,
                                truncation=self.cfg.truncation, truncation_penalty=self.cfg.truncation_penalty,
                                greedy=True, device=self.device)
            rewards = batch.rewards.to(self.device, torch.float64)
            sums = torch.stack([rewards.sum(), self._correct(batch).double().sum(),
                                rewards.new_tensor(float(len(examples)))])
            samples = list(zip(batch.prompts[:4], batch.completions[:4]))
        total = _all_sum(sums)
        return {"eval_reward": float(total[0] / total[2]), "eval_accuracy": float(total[1] / total[2]),
                "samples": samples}

    def save(self) -> None:
        checkpoint.save(self.run_dir, model=self.policy, optimizer=self.optimizer, scheduler=self.scheduler,
                        step=self.step, config=to_dict(self.cfg), prompt_rng=self.prompt_rng, rank=self.rank,
                        world_size=self.world, barrier=dist.barrier if self.world > 1 else None)

    def _metrics_file(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _prepare_metrics_file(self) -> None:
        """Start fresh (an earlier run's checkpoint keeps its metrics aside until this run's first save), or on resume
        keep only the lines up to the checkpoint's step, of the checkpoint's own run."""
        path = self._metrics_file()
        if self.rank != 0 or self._metrics_prepared:  # a later train() call of this trainer goes on appending
            return
        self._metrics_prepared = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.step == 0:
            checkpoint.set_metrics_aside(self.run_dir, path)
            path.write_text("")
            return
        aside = checkpoint.metrics_aside(self.run_dir)  # a later run started over here and stopped before saving
        source = self.run_dir if aside is None else aside.parent
        if not (source / "metrics.jsonl").is_file():
            path.write_text("")
            return
        kept = [record for record in read_metrics(source) if record.get("step", 0) <= self.step]
        path.write_text("".join(json.dumps(record) + "\n" for record in kept))
        if aside is not None:
            checkpoint.drop_metrics_aside(self.run_dir)

    def train(self, stop_after: Optional[int] = None) -> list[dict]:
        """Train to ``cfg.steps`` (``stop_after``: return after that many steps of this call, as an
        interrupted run would, having checkpointed at every ``save_every``)."""
        cfg = self.cfg
        self._prepare_metrics_file()
        if self.rank == 0:
            (self.run_dir / "config.yaml").write_text(yaml_dump(to_dict(cfg)))
        history: list[dict] = []
        bar = None
        if cfg.progress and not self.quiet and sys.stderr.isatty():  # logs get the plain lines below
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, desc="fused-rl train", dynamic_ncols=True)
        if not self.quiet:
            n_params = sum(p.numel() for p in self.policy.parameters())
            print(f"fused-rl train: {n_params / 1e6:.2f} M parameters on {self.device}, loss backend "
                  f"{self.backend!r}, world size {self.world}, run dir {self.run_dir}", flush=True)
            if not cfg.resume and self.rank == 0 and checkpoint.exists(self.run_dir):
                print(f"fused-rl train: run dir {self.run_dir} holds an earlier run's checkpoint: starting over, it "
                      "is overwritten at the first save (until then --resume true continues it, with its own "
                      "metrics)", flush=True)
            if self.step >= cfg.steps:
                print(f"fused-rl train: the checkpoint is at step {self.step} >= steps = {cfg.steps}: nothing to "
                      "train (raise --steps to go on)", flush=True)
            elif self.resume_changes and self.rank == 0:
                changes = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in self.resume_changes.items())
                print(f"fused-rl train: resuming at step {self.step} with fields changed since the checkpoint, "
                      f"applied from here: {changes}", flush=True)

        def show(line: str) -> None:
            if bar is not None:
                bar.write(line)  # above the bar
            else:
                print(line, flush=True)

        start = time.perf_counter()
        if cfg.eval_every and self.step == 0:  # the starting point of the curve (every process evaluates its share)
            ev = self.evaluate()
            ev.pop("samples")
            if self.rank == 0:
                with open(self._metrics_file(), "a") as f:
                    f.write(json.dumps({"step": 0, **ev}) + "\n")
            if not self.quiet:
                show(f"step 0: {format_eval(ev)}")
        done = 0
        while self.step < cfg.steps and (stop_after is None or done < stop_after):
            done += 1
            metrics = self.train_step()
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                ev = self.evaluate()
                ev.pop("samples")
                metrics.update(ev)
            metrics["elapsed_s"] = time.perf_counter() - start
            history.append(metrics)
            if self.rank == 0:  # every step; log_every only thins the plain console lines
                with open(self._metrics_file(), "a") as f:
                    f.write(json.dumps(metrics) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(format_postfix(metrics))
            # log_every thins the plain lines; the last step and every evaluation are printed (on a terminal the
            # bar shows each step, an evaluation is also written above it)
            plain_line = bar is None and (self.step % cfg.log_every == 0 or self.step == cfg.steps)
            if not self.quiet and (plain_line or "eval_reward" in metrics):
                show(f"step {self.step}: {format_postfix(metrics)}")
            if cfg.save_every and self.step % cfg.save_every == 0:
                self.save()
        if bar is not None:
            bar.close()
        if history and stop_after is None and not (cfg.save_every and self.step % cfg.save_every == 0):
            self.save()
        if self.rank == 0 and cfg.plot and history:
            from .plot import plot_run

            png = plot_run(self.run_dir)
            if not self.quiet:
                print(f"wrote {self._metrics_file()} and {png}")
        return history


def format_eval(m: dict) -> str:
    return f"eval={m['eval_reward']:.3f} eval_acc={m['eval_accuracy']:.2f}"


def format_postfix(m: dict) -> str:
    parts = [f"reward={m['reward']:.3f}", f"acc={m['accuracy']:.2f}"]
    if "eval_reward" in m:
        parts.append(format_eval(m))
    if "kl" in m:
        parts.append(f"kl={m['kl']:.4f}")
    parts += [f"clip={m.get('clip_frac', 0.0):.3f}",
              f"ent={m.get('entropy', 0.0):.3f}", f"len={m['length']:.1f}", f"tok/s={m['tokens_per_s']:.0f}"]
    return " ".join(parts)


