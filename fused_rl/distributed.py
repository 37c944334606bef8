"""torch.distributed helpers for the loss math's cross-process options.

``top_entropy_quantile``'s threshold over every process's tokens, as TRL takes it::

    import functools
    from fused_rl.distributed import all_gather_1d
    from fused_rl.loss_math import entropy_quantile_across

    with entropy_quantile_across(functools.partial(all_gather_1d, group=None)):
        out = fused_rl.linear_policy_loss(hidden, weight, targets, advantages, mask, config=config)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def all_gather_1d(local: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The concatenation, in rank order, of every process's 1-D ``local`` (lengths may differ): the lengths
    are all-gathered first (a host sync), then the tensors padded to the longest, all-gathered and cut
    back. Every process of ``group`` must call it (a collective)."""
    if local.dim() != 1:
        raise ValueError(f"all_gather_1d takes a 1-D tensor, got shape {tuple(local.shape)}")
    world = dist.get_world_size(group)
    length = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    padded = local.new_zeros(max(sizes))
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


__all__ = ["all_gather_1d"]
