"""Writes ``verl_bypass_golden.json``: verl 0.9.1's own ``compute_policy_loss_bypass_mode`` (its loss, the gradient
in ``log_prob`` and every metric, ``rollout_corr/*`` included) on one fixed ragged batch, for the rollout-correction
configs of ``CASES``. ``tests/test_verl.py`` checks fused_rl's verl adapter against these values.

Run by hand (verl is not a dependency; its imports are stubbed, only ``core_algos.py``, ``rollout_corr_helper.py`` and
``utils/torch_functional.py`` of the wheel run)::

    pip download verl==0.9.1 --no-deps -d /tmp/verl && unzip -q /tmp/verl/verl-0.9.1-py3-none-any.whl -d /tmp/verl/src
    python tests/data/make_verl_bypass_golden.py /tmp/verl/src
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import torch

CASES = {
    "ppo_clip-rs-token_k1": {"loss_type": "ppo_clip", "rollout_is": "token", "rollout_rs": "token_k1",
                             "rollout_rs_threshold": "0.7_1.6"},
    "ppo_clip-normalize-seq_mean_k3": {"loss_type": "ppo_clip", "rollout_is": "sequence",
                                       "rollout_is_batch_normalize": True, "rollout_rs": "seq_mean_k3",
                                       "rollout_rs_threshold": 0.2},
    "ppo_clip-metrics-only": {"loss_type": "ppo_clip"},
    "reinforce-token-tis-normalize": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.5,
                                      "rollout_is_batch_normalize": True},
    "reinforce-sequence-icepop-normalize": {"loss_type": "reinforce", "rollout_is": "sequence",
                                            "rollout_is_threshold": "0.05_20", "rollout_is_batch_normalize": True},
    "reinforce-token-icepop-rs-chain": {"loss_type": "reinforce", "rollout_is": "token",
                                        "rollout_is_threshold": "0.5_2.0",
                                        "rollout_rs": "token_k2, seq_max_k3,seq_sum_k1", "rollout_rs_threshold":
                                        "0.3,0.5,0.2_4.0"},
    "reinforce-rs-shared-threshold": {"loss_type": "reinforce", "rollout_rs": "token_k3,seq_mean_k2,seq_sum_k2",
                                      "rollout_rs_threshold": "0.15"},
    "reinforce-sequence-tis-rs-k1-upper": {"loss_type": "reinforce", "rollout_is": "sequence",
                                           "rollout_is_threshold": "3.0", "rollout_rs": "seq_mean_k1,token_k1",
                                           "rollout_rs_threshold": "1.3,2.5"},
    "reinforce-rs-seq_sum_k3": {"loss_type": "reinforce", "rollout_is": "token", "rollout_rs": "seq_sum_k3",
                                "rollout_rs_threshold": 1.0},
    "reinforce-token-unbounded-normalize": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold":
                                            "inf", "rollout_is_batch_normalize": True},
    "ppo_clip-sequence-unbounded": {"loss_type": "ppo_clip", "rollout_is": "sequence", "rollout_is_threshold": "inf"},
}
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
#: verl's ``global_batch_info`` of a data-parallel step (two ranks), for one case again.
GLOBAL = {"case": "reinforce-token-icepop-rs-chain", "info": {"dp_size": 2, "batch_num_tokens": 30,
                                                               "global_batch_size": 9}}


def batch():
    """Five ragged responses (one empty, one of length 1), rollout log-probs 0.6 randn off the current ones."""
    g = torch.Generator().manual_seed(2027)
    lengths = (7, 3, 0, 5, 1)
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).to(torch.float64)
    log_prob = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3 - 0.05
    rollout = log_prob + 0.6 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    adv = torch.randn(5, 7, generator=g, dtype=torch.float64)
    return rollout, log_prob, adv, mask


def _load_verl(src: Path):
    def stub(name, **attrs):
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        sys.modules[name] = module
        return module

    class Anything:
        def __init__(self, *args, **kwargs):
            pass

    stub("omegaconf", DictConfig=Anything)
    stub("tensordict", TensorDict=Anything)
    stub("verl")
    stub("verl.utils", as_torch_index=None, group_mean_std=None)
    stub("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    stub("verl.utils.import_utils", deprecated=lambda *a, **k: (lambda f: f))
    stub("verl.trainer")
    stub("verl.trainer.ppo")
    stub("verl.trainer.config", AlgoConfig=type("AlgoConfig", (), {}))
    stub("verl.trainer.config.algorithm", RolloutCorrectionConfig=Anything)
    stub("verl.workers")
    stub("verl.workers.config", ActorConfig=Anything)
    stub("verl.workers.config.actor", PolicyLossConfig=Anything)
    stub("verl.protocol", DataProto=type("DataProto", (), {
        "from_dict": staticmethod(lambda tensors: types.SimpleNamespace(batch=tensors))}))
    modules = {}
    for name, path in (("verl.utils.torch_functional", "utils/torch_functional.py"),
                       ("verl.trainer.ppo.core_algos", "trainer/ppo/core_algos.py"),
                       ("verl.trainer.ppo.rollout_corr_helper", "trainer/ppo/rollout_corr_helper.py")):
        spec = importlib.util.spec_from_file_location(name, src / "verl" / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        parent, _, leaf = name.rpartition(".")
        setattr(sys.modules[parent], leaf, module)
        spec.loader.exec_module(module)
        modules[leaf] = module
    return modules["core_algos"]


class _ActorConfig(dict):
    """The attributes and ``get`` verl's policy losses read."""
    __getattr__ = dict.__getitem__


def main(src: str) -> None:
    core_algos = _load_verl(Path(src))
    rollout, log_prob, adv, mask = batch()
    out = {"inputs": {"rollout": rollout.tolist(), "log_prob": log_prob.tolist(), "advantages": adv.tolist(),
                      "mask": mask.tolist()}, "clip_ratio": 0.2, "cases": {}}
    runs = [(name, corr, agg, {}) for name, corr in CASES.items() for agg in AGGS]
    runs += [(GLOBAL["case"] + "|global", CASES[GLOBAL["case"]], agg, GLOBAL["info"]) for agg in AGGS]
    for name, corr, agg, info in runs:
        config = _ActorConfig(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                              global_batch_info=info, policy_loss={"rollout_correction": corr})
        lp = log_prob.clone().requires_grad_(True)
        loss, metrics = core_algos.compute_policy_loss_bypass_mode(rollout, lp, adv, mask, agg, config)
        loss.backward()
        out["cases"][f"{name}|{agg}"] = {
            "rollout_correction": corr, "global_batch_info": info, "loss_agg_mode": agg, "loss": loss.item(),
            "grad": lp.grad.tolist(), "metrics": {k: float(v) for k, v in metrics.items()}}
    path = Path(__file__).with_name("verl_bypass_golden.json")
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path} ({len(out['cases'])} cases)")


if __name__ == "__main__":
    main(sys.argv[1])
