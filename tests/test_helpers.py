"""The comparison rule of ``helpers.Expected`` (what every backend test checks against), on synthetic values."""

import pytest
import torch

from helpers import Expected


def _expected(with_oracle: bool) -> Expected:
    """bf16 / fp16 inputs: ``values`` from the fp32 reference (here 2.5e-3 off the exact 1.0, as a fuzz example's
    grad_weight entry at a 32x cancellation of the policy and KL terms), the fp64 oracle as the fallback."""
    oracle = lambda: ({"x": torch.tensor([1.0, 2.0], dtype=torch.float64)}, {"x": (0.0, 1e-3)})
    return Expected({"x": torch.tensor([1.0025, 2.0])}, {"x": (0.0, 1e-3)}, oracle if with_oracle else None)


def test_a_value_near_the_exact_one_passes_where_the_fp32_reference_is_off():
    _expected(True).check("x", torch.tensor([1.0004, 2.0]))
    with pytest.raises(AssertionError, match="1 / 2 elements beyond the tolerance"):
        _expected(False).check("x", torch.tensor([1.0004, 2.0]))


@pytest.mark.parametrize("actual", [[0.998, 2.0], [1.0004, 2.003], [1.006, 2.0]])
def test_a_value_far_from_both_references_fails(actual):
    """Only the elements where the references disagree take the oracle; a value far from both fails."""
    with pytest.raises(AssertionError, match="beyond the tolerance"):
        _expected(True).check("x", torch.tensor(actual))
