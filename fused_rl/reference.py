"""The slow, obviously correct implementations of the public functions.

Same signatures as :mod:`fused_rl.ops` without ``backend``: each runs the ``"reference"`` backend,
a full fp32 (fp64 for fp64 input) ``log_softmax`` over the vocabulary with plain autograd, followed
by the single definition of the loss math in :mod:`fused_rl.loss_math`.
"""

from __future__ import annotations

from functools import wraps

from . import ops


def _reference(fn):
    @wraps(fn)
    def wrapper(*args, **kwargs):
        if "backend" in kwargs:
            raise TypeError(f"fused_rl.reference.{fn.__name__} takes no backend argument")
        return fn(*args, backend="reference", **kwargs)

    return wrapper


token_logprobs = _reference(ops.token_logprobs)
policy_loss = _reference(ops.policy_loss)
linear_policy_loss = _reference(ops.linear_policy_loss)
linear_token_logprobs = _reference(ops.linear_token_logprobs)

__all__ = ["token_logprobs", "policy_loss", "linear_policy_loss", "linear_token_logprobs"]
