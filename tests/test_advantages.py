"""Advantage estimators against the seed lecture's worked numbers and exact expectations."""

import itertools
import math

import pytest
import torch

from fused_rl import advantages


def test_grpo_seed_examples():
    a = advantages.grpo(torch.tensor([1.0, 0, 0, 0]), 4)
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(a, torch.tensor([s3, -1 / s3, -1 / s3, -1 / s3]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(advantages.grpo(torch.tensor([1.0, 1, 0, 0]), 4), torch.tensor([1.0, 1, -1, -1]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.37])
def test_grpo_equal_rewards_give_zero_not_huge(value):
    a = advantages.grpo(torch.full((8,), value), 4)
    assert torch.equal(a, torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_grpo_equal_rewards_are_exactly_zero_whatever_the_rounding_of_the_mean(dtype):
    """fp32 means of k/d rewards are often 1 ulp off: std ~1e-8 and / (std + eps) once gave 0.03 to 1."""
    for group_size, k, d in itertools.product(range(2, 17), range(1, 13), range(1, 13)):
        r = torch.full((2 * group_size,), k / d, dtype=dtype)
        a = advantages.grpo(r, group_size)
        assert torch.equal(a, torch.zeros_like(a))
    assert torch.equal(advantages.grpo(torch.full((3,), 1e6 + 0.1), 3), torch.zeros(3))


def test_grpo_groups_are_independent_and_population_std():
    r = torch.tensor([1.0, 0, 0, 0, 3.0, 1.0, 2.0, 2.0])
    a = advantages.grpo(r, 4, eps=1e-12)
    g2 = r[4:]
    expected2 = (g2 - g2.mean()) / g2.std(unbiased=False)
    torch.testing.assert_close(a[4:], expected2)
    torch.testing.assert_close(advantages.grpo(r, 4, scale=False)[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_rloo_leave_one_out():
    r = torch.tensor([1.0, 0, 0, 0])
    # R_i - mean of the other three
    torch.testing.assert_close(advantages.rloo(r, 4), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # equals G/(G-1) times the centred reward
    r = torch.randn(12, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(advantages.rloo(r, 3), 1.5 * advantages.grpo(r, 3, scale=False))


def test_kimi_length_table():
    lengths = torch.tensor([100.0, 300.0, 500.0])
    torch.testing.assert_close(advantages.kimi_length_reward(lengths, torch.tensor([True, True, True]), 3),
                               torch.tensor([0.5, 0.0, -0.5]))
    torch.testing.assert_close(advantages.kimi_length_reward(lengths, torch.tensor([0, 0, 0]), 3),
                               torch.tensor([0.0, 0.0, -0.5]))
    # zero crossing at the midrange, not the mean: lengths 100, 150, 500 -> midrange 300
    out = advantages.kimi_length_reward(torch.tensor([100.0, 150.0, 500.0]), torch.tensor([1, 1, 1]), 3)
    torch.testing.assert_close(out, torch.tensor([0.5, 0.375, -0.5]))
    # equal-length group: zero by definition
    assert torch.equal(advantages.kimi_length_reward(torch.full((4,), 7.0), torch.tensor([1, 0, 1, 0]), 4),
                       torch.zeros(4))



@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.float16, torch.bfloat16,
                                   torch.float32, torch.float64])
def test_kimi_length_table_in_every_dtype(dtype):
    """The seed's table from lengths of any integer or floating dtype (token counts come as int64; uint8: a tenth)."""
    lengths = torch.tensor([100, 300, 500], dtype=torch.int64) // (10 if dtype == torch.uint8 else 1)
    lengths = lengths.to(dtype)
    out = advantages.kimi_length_reward(lengths, torch.tensor([True, True, True]), 3)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.tolist() == [0.5, 0.0, -0.5]
    assert advantages.kimi_length_reward(lengths, torch.tensor([0, 0, 0]), 3).tolist() == [0.0, 0.0, -0.5]


def test_kimi_length_reward_is_exact_for_huge_lengths():
    """Lengths are differenced before any rounding: int64 lengths past 2**24 (float32's last exact integer) keep
    their spread (they were all rounded to one value: zeros), and no span overflows at any dtype's largest values
    (negative lengths, refused below, made a span past float32's max: NaN)."""
    big = 2 ** 25
    out = advantages.kimi_length_reward(torch.tensor([big, big + 1, big + 2]), torch.ones(3, dtype=torch.bool), 3)
    assert out.tolist() == [0.5, 0.0, -0.5]  # was [0, 0, 0]: float32 rounded all three to 2**25
    top = 2 ** 63 - 1
    out = advantages.kimi_length_reward(torch.tensor([top - 2, top - 1, top, 0]), torch.ones(4), 4)
    torch.testing.assert_close(out, torch.tensor([-0.5, -0.5, -0.5, 0.5]))
    assert advantages.kimi_length_reward(torch.tensor([top, top - 2, top - 1]), torch.ones(3), 3).tolist() == \
        [-0.5, 0.5, 0.0]
    for dtype, hi in ((torch.float32, 3.4e38), (torch.float64, 1.7e308), (torch.float16, 65504.0)):
        lengths = torch.tensor([0.0, hi / 2, hi], dtype=dtype)
        out = advantages.kimi_length_reward(lengths, torch.ones(3), 3)
        torch.testing.assert_close(out, torch.tensor([0.5, 0.0, -0.5], dtype=out.dtype), atol=1e-3, rtol=0)
    tiny = torch.tensor([1e-45, 0.0, 3e-45])  # float32 subnormals
    assert advantages.kimi_length_reward(tiny, torch.ones(3), 3).tolist() == [0.0, 0.5, -0.5]
    # equal lengths, huge or not: zero by definition
    assert advantages.kimi_length_reward(torch.full((3,), top), torch.ones(3), 3).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("lengths, match", [
    (torch.tensor([-100.0, 0.0, 300.0]), "lengths must be >= 0"),
    (torch.tensor([-1, 5, 7]), "lengths must be >= 0"),
    (torch.tensor([1.0, float("inf"), 3.0]), "lengths contain NaN or inf"),
    (torch.tensor([True, False, True]), "lengths must be token counts"),
])
def test_kimi_length_reward_refuses_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        advantages.kimi_length_reward(lengths, torch.ones(3), 3)


def _categorical_problem():
    logits = torch.tensor([0.3, -0.5, 0.9], dtype=torch.float64)
    reward = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    pi = torch.softmax(logits, 0)
    eye = torch.eye(3, dtype=torch.float64)
    score = eye - pi  # score[a] = d log pi(a) / d logits
    true_grad = (pi.unsqueeze(1) * reward.unsqueeze(1) * score).sum(0)
    return pi, reward, score, true_grad


@pytest.mark.parametrize("group_size", [2, 4])
def test_mean_baseline_bias_exact_enumeration(group_size):
    """E[(1/G) sum_i (R_i - mean R) g_i] = (1 - 1/G) grad J, and RLOO is unbiased: exact over all K^G groups."""
    pi, reward, score, true_grad = _categorical_problem()
    outcomes = torch.tensor(list(itertools.product(range(3), repeat=group_size)))  # (K^G, G)
    prob = pi[outcomes].prod(dim=1)
    rewards = reward[outcomes].reshape(-1)
    g = score[outcomes]  # (K^G, G, K)
    for estimator, factor in ((advantages.grpo(rewards, group_size, scale=False), 1 - 1 / group_size),
                              (advantages.rloo(rewards, group_size), 1.0)):
        per_group = (estimator.reshape(-1, group_size, 1) * g).mean(dim=1)
        expectation = (prob.unsqueeze(1) * per_group).sum(0)
        torch.testing.assert_close(expectation, factor * true_grad, rtol=1e-10, atol=1e-12)


def test_mean_baseline_bias_monte_carlo():
    """The same statement sampled: 200k groups of G=4, within 5 standard errors."""
    pi, reward, score, true_grad = _categorical_problem()
    gen = torch.Generator().manual_seed(1234)
    groups, G = 200_000, 4
    actions = torch.multinomial(pi, groups * G, replacement=True, generator=gen).reshape(groups, G)
    rewards = reward[actions].reshape(-1)
    g = score[actions]
    for estimator, factor in ((advantages.grpo(rewards, G, scale=False), 0.75), (advantages.rloo(rewards, G), 1.0)):
        samples = (estimator.reshape(groups, G, 1) * g).mean(dim=1)
        mean, sem = samples.mean(0), samples.std(0) / math.sqrt(groups)
        assert ((mean - factor * true_grad).abs() < 5 * sem).all(), (mean, factor * true_grad, sem)
    # and the biased estimator is detectably not unbiased
    samples = (advantages.grpo(rewards, G, scale=False).reshape(groups, G, 1) * g).mean(dim=1)
    assert ((samples.mean(0) - true_grad).abs() > 5 * samples.std(0) / math.sqrt(groups)).any()


def test_gae_telescopes_for_gamma_lambda_one():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1]]).bool()  # right and left pad
    adv, ret = advantages.gae(r, v, mask)
    for b in range(3):
        idx = mask[b].nonzero().flatten().tolist()
        for k, t in enumerate(idx):
            expected = sum(r[b, u].item() for u in idx[k:]) - v[b, t].item()
            assert adv[b, t].item() == pytest.approx(expected, abs=1e-5)
            assert ret[b, t].item() == pytest.approx(expected + v[b, t].item(), abs=1e-5)
    assert (adv[~mask] == 0).all()


def test_gae_hand_computed():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, _ = advantages.gae(r, v, torch.ones(1, 3, dtype=torch.bool), gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))


@pytest.mark.parametrize("call, match", [
    (lambda: advantages.grpo(torch.ones(5), 4), "multiple of group_size"),
    (lambda: advantages.grpo(torch.ones(2, 4), 4), "1-D"),
    (lambda: advantages.grpo(torch.tensor([1.0, float("nan")]), 2), "NaN"),
    (lambda: advantages.grpo(torch.ones(4), 0), "group_size"),
    (lambda: advantages.grpo(torch.ones(4), 2, eps=0.0), "eps must be > 0"),  # 0 / 0 for equal rewards
    (lambda: advantages.rloo(torch.ones(4), 1), "group_size >= 2"),
    (lambda: advantages.kimi_length_reward(torch.ones(4), torch.tensor([0, 2, 1, 0]), 2), "0/1"),
    (lambda: advantages.gae(torch.ones(2, 3), torch.ones(2, 2), torch.ones(2, 3)), "one shape"),
    (lambda: advantages.gae(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), gamma=1.5), "gamma"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_one_sample_groups_are_refused():
    """A group of one is its own baseline: every grpo advantage would be 0 (no signal, no error)."""
    with pytest.raises(ValueError, match="group_size >= 2"):
        advantages.grpo(torch.tensor([1.0, 0.0]), 1)


def test_gae_refuses_a_weighted_mask():
    rewards = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="mask must contain only 0 and 1"):
        advantages.gae(rewards, rewards, torch.tensor([[1.0, 0.5, 0.0]]))


@pytest.mark.parametrize("scale", ["none", "batch", "group", 0, None])
def test_grpo_scale_must_be_a_bool(scale):
    """TRL spells its option ``scale_rewards="none" / "group" / "batch"``: a truthy "none" silently divided by
    the group std (and "batch" by the group's, not the batch's)."""
    with pytest.raises(ValueError, match="scale must be a bool"):
        advantages.grpo(torch.tensor([1.0, 0.0]), 2, scale=scale)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_rewards_are_differenced_exactly(dtype):
    """Integer rewards were rounded to float32 before the group mean: past 2**24 neighbours became one value."""
    r = torch.tensor([2 ** 24, 2 ** 24 + 1, 2 ** 24 + 1, 2 ** 24], dtype=dtype)
    expected = torch.tensor([-1.0, 1.0, 1.0, -1.0])
    torch.testing.assert_close(advantages.grpo(r, 4), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(advantages.grpo(r, 4, scale=False), expected / 2)
    torch.testing.assert_close(advantages.rloo(r, 4), expected * 2 / 3)
    assert advantages.grpo(r, 4).dtype == advantages.rloo(r, 4).dtype == torch.float32


def test_rloo_is_exact_for_equal_and_huge_rewards():
    """rloo summed the group in the rewards' float32: equal rewards k/d left ~1e-8 advantages, and a finite
    group whose sum passes float32's max gave -inf."""
    for group_size, k, d in itertools.product(range(2, 9), range(1, 13), range(1, 13)):
        a = advantages.rloo(torch.full((group_size,), k / d), group_size)
        assert torch.equal(a, torch.zeros_like(a)), (group_size, k, d, a)
    assert torch.equal(advantages.rloo(torch.tensor([3e38, 3e38]), 2), torch.zeros(2))
    torch.testing.assert_close(advantages.rloo(torch.tensor([3e38, 1e38]), 2), torch.tensor([2e38, -2e38]))


@pytest.mark.parametrize("call", [
    lambda: advantages.grpo(torch.tensor([3.4e38, -3.4e38, -3.4e38, -3.4e38]), 4, scale=False),  # 5.1e38
    lambda: advantages.rloo(torch.tensor([3e38, -3e38]), 2),  # 6e38
    lambda: advantages.grpo(torch.tensor([1.7e308, -1.7e308], dtype=torch.float64), 2, scale=False),  # 3.4e308
])
def test_advantages_that_overflow_are_refused(call):
    """Finite rewards whose advantages do not fit the output dtype gave inf / NaN advantages, silently."""
    with pytest.raises(ValueError, match="overflow"):
        call()


@pytest.mark.parametrize("rewards, expected", [
    ([1e200, 0.0], [1.0, -1.0]),
    ([1e160, 0.0, 0.0, 0.0], [3 ** 0.5, -(3 ** -0.5), -(3 ** -0.5), -(3 ** -0.5)]),
    ([1.7e308, -1.7e308], [1.0, -1.0]),
    ([1e300, 1e300], [0.0, 0.0]),
    ([5e-324, 0.0], [0.0, 0.0]),  # spread far below eps: (R - mean) / eps, 0 in fp64 too
])
def test_grpo_of_huge_fp64_rewards_is_their_standard_score(rewards, expected):
    """Scaled GRPO advantages are at most sqrt(G - 1) whatever the rewards: fp64 rewards spread past 1e154 gave
    zeros without a word (the squares in the std overflowed) and +-1.7e308 an overflow error."""
    a = advantages.grpo(torch.tensor(rewards, dtype=torch.float64), len(rewards))
    torch.testing.assert_close(a, torch.tensor(expected, dtype=torch.float64))
    # equal rewards whose eps / |R| underflows: 0, not 0 / 0
    equal = advantages.grpo(torch.tensor([1e300, 1e300], dtype=torch.float64), 2, eps=1e-300)
    assert torch.equal(equal, torch.zeros(2, dtype=torch.float64))


def test_grpo_rewards_at_their_group_mean_are_exactly_zero():
    """The scaling is by a power of two, exact: an integer reward equal to its group's mean stays exactly 0 (a
    scaling by the largest |R| itself, 9 here, gave -5.7e-17)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.cat([torch.tensor([6.0, 8, 9, 4, 2, 5, 8, 6]), torch.randint(0, 11, (2000 * 8,), generator=g)])
    groups = rewards.reshape(-1, 8).double()
    at_mean = groups == groups.mean(dim=1, keepdim=True)
    a = advantages.grpo(rewards, 8).reshape(-1, 8)
    assert at_mean.sum() > 100 and torch.equal(a[at_mean], torch.zeros(int(at_mean.sum())))


def test_gae_of_empty_sequences_is_empty():
    """T = 0 gave an IndexError from inside (``r[:, 0]`` of a ``(B, 0)`` tensor)."""
    adv, ret = advantages.gae(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    assert adv.shape == ret.shape == (2, 0)


def test_advantages_are_detached():
    """The lecture: reward advantages are detached from differentiation (gae detached only the values)."""
    r = torch.tensor([1.0, 0.0, 0.5, 0.5], requires_grad=True)
    assert not advantages.grpo(r, 2).requires_grad
    assert not advantages.grpo(r, 2, scale=False).requires_grad
    assert not advantages.rloo(r, 2).requires_grad
    adv, ret = advantages.gae(r.reshape(2, 2), torch.zeros(2, 2), torch.ones(2, 2))
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.parametrize("call, match", [
    (lambda: advantages.grpo(torch.tensor([1.0, 0.0]), 2, eps=float("inf")), "eps must be"),  # all zeros
    (lambda: advantages.grpo(torch.tensor([1.0, float("nan")]), 2, eps=float("nan")), "eps must be"),
    (lambda: advantages.grpo(torch.tensor([1 + 1j, 0j]), 2), "real"),  # the imaginary part was dropped
    (lambda: advantages.rloo(torch.tensor([1 + 1j, 0j]), 2), "real"),
])
def test_more_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _gae_loop(r, v, m, gamma, lam):
    """GAE per row as a plain loop over its kept positions (V and A after the last one 0), in Python floats."""
    adv = torch.zeros(r.shape, dtype=torch.float64)
    for b in range(r.shape[0]):
        a = next_v = 0.0
        for t in reversed(m[b].nonzero().flatten().tolist()):
            a = float(r[b, t]) + gamma * next_v - float(v[b, t]) + gamma * lam * a
            adv[b, t], next_v = a, float(v[b, t])
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7), (1.0, 0.9)])
def test_gae_matches_a_loop_across_blocks(gamma, lam):
    """Lengths across several of ``discounted_suffix_sums``' blocks (600 = 2 x 256 + 88), holes, left and right
    padding, an empty row and a one-token row, in float64: the blocked scan equals the loop to rounding."""
    g = torch.Generator().manual_seed(1)
    r = torch.randn(5, 600, generator=g, dtype=torch.float64)
    v = torch.randn(5, 600, generator=g, dtype=torch.float64)
    m = torch.rand(5, 600, generator=g) > 0.3
    m[0] = True  # all three blocks
    m[1, :100] = False  # left padding
    m[2, 450:] = False  # right padding
    m[3] = False
    m[4] = False
    m[4, 257] = True
    adv, ret = advantages.gae(r, v, m, gamma=gamma, lam=lam)
    expected = _gae_loop(r, v, m, gamma, lam)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(m, expected + v, 0.0), rtol=1e-12, atol=1e-12)


def test_discounted_suffix_sums():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]], dtype=torch.float64)
    for block in (1, 2, 3, 5, 256):
        y = advantages.discounted_suffix_sums(x, 0.5, block=block)
        assert torch.equal(y, torch.tensor([[1 + 1 + 0.75 + 0.5 + 0.3125, 2 + 1.5 + 1 + 0.625, 3 + 2 + 1.25,
                                             4 + 2.5, 5.0]], dtype=torch.float64)), block
    assert advantages.discounted_suffix_sums(torch.zeros(3, 0), 0.9).shape == (3, 0)


def test_gae_scans_in_float64():
    """One reward at the end and ``gamma = lam = 1``: ``A_t = R - V_t`` and the returns are ``R``, to one rounding
    (the float32 scan drifted to 6e-6 at T = 2048, 5e-5 at 32k); values too large for float32 are refused."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 2048, generator=g) * 0.5 + 2.0
    reward = torch.randn(4, generator=g)
    rewards = torch.zeros(4, 2048)
    rewards[:, -1] = reward
    adv, ret = advantages.gae(rewards, values, torch.ones(4, 2048))
    assert adv.dtype == ret.dtype == torch.float32
    assert torch.equal(adv, (reward.double()[:, None] - values.double()).float())
    assert torch.equal(ret, reward[:, None].expand(4, 2048))
    with pytest.raises(ValueError, match="gae advantages overflow torch.float32"):
        advantages.gae(torch.zeros(1, 2), torch.full((1, 2), 1e300, dtype=torch.float64), torch.ones(1, 2))
