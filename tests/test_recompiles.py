"""Recompilation under ``torch.compile``: a training step compiled once, called with a new completion length
``T``, batch ``B``, advantages and ``token_normalizer`` every step.

What a user compiling their step expects, checked for ``policy_loss``, ``linear_policy_loss``,
``token_logprobs`` and ``linear_token_logprobs`` on the ``torch``, ``cpu`` and ``triton`` backends:

* ``fullgraph=True`` traces (no graph break);
* no recompilation per step: at most two graphs for six steps under torch's automatic dynamic shapes (the
  first call is specialized; the first new length / batch / normalizer value makes them symbolic), one with
  ``dynamic=True`` or the shapes marked dynamic and a tensor normalizer;
* a Python-number ``token_normalizer`` is not a constant of the graph (torch >= 2.6 leaves floats
  unspecialized, ``torch._dynamo.config.specialize_float = False``): one recompile, then symbolic; with
  ``specialize_float = True`` a float is one graph per value, a 0-dim tensor still one graph;
* loss, metrics and gradients equal to the eager call.

A temperature that is an argument of the compiled step and ``inplace=True`` with dynamic shapes broke
``fullgraph=True`` until ``fused_rl/validation.py`` stopped calling ``math.isfinite`` on the temperature
(``check_temperature``) and ``sorted(key=...)`` on the strides (``check_rows_disjoint``): dynamo traces neither on
symbolic values; and a numpy-scalar normalizer (traced as an ndarray) until validation took arrays as tensors.

Graphs are counted with ``counters["stats"]["unique_graphs"]``: ``CompileCounter.frame_count`` also counts a
compile that dynamo restarts (``_tensorify_python_scalars`` restarts the analysis once when the config's floats
are symbolic under ``dynamic=True``), which is one graph, not a recompile.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported (they are lazy)

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import fused_rl
from fused_rl import PolicyLossConfig

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

AVAILABLE = fused_rl.available_backends(torch.device("cpu"))
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(AVAILABLE[b] is not None, reason=str(AVAILABLE[b])))
            for b in ("torch", "cpu")]
HAS_TRITON = AVAILABLE["triton"] is None

VOCAB, HIDDEN = 33, 8
#: six steps of (B, T): B and T both change at the first new step (automatic dynamic promotes both at once),
#: no first step with B == T (duck sizing would give them one symbol)
SHAPES = [(2, 3), (3, 5), (2, 7), (4, 4), (3, 6), (2, 9)]
#: dapo (single pass on cpu / triton: token-local epilogue) with a k3 KL, and gspo (two-pass composition)
CONFIG = PolicyLossConfig.preset("dapo", kl="k3", beta=0.01)
GSPO = PolicyLossConfig(policy_loss="gspo", kl="k3", beta=0.02)
TIGHT = dict(rtol=1e-6, atol=1e-6)


def _step_inputs(i, batch, length, normalizer, linear=False, seed=0):
    """The tensors of step ``i``: ``x`` (logits ``(B, T, V)`` or hidden ``(B, T, H)``), targets, advantages,
    mask, old / ref log-probs, and the normalizer (the step's token count, varied) as ``normalizer`` says."""
    g = torch.Generator().manual_seed(seed + 101 * i)
    x = torch.randn(batch, length, HIDDEN if linear else VOCAB, generator=g)
    targets = torch.randint(0, VOCAB, (batch, length), generator=g)
    mask = torch.rand(batch, length, generator=g) > 0.2
    mask[:, 0] = True
    advantages = torch.randn(batch, generator=g)
    old = -3.0 + 0.3 * torch.randn(batch, length, generator=g)
    ref = -3.0 + 0.3 * torch.randn(batch, length, generator=g)
    count = float(mask.sum()) + 0.25 * i
    n = {"float": count, "tensor": torch.tensor(count), "int": int(mask.sum()) + i, "none": None,
         "numpy": np.float64(count)}[normalizer]
    return x, targets, advantages, mask, old, ref, n


def _weight(seed=1):
    g = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(VOCAB, HIDDEN, generator=g)


def _mark_dynamic(*tensors):
    for t in tensors:
        torch._dynamo.mark_dynamic(t, list(range(min(t.dim(), 2))))


def _fresh():
    torch._dynamo.reset()
    counters.clear()


def _graphs():
    return counters["stats"]["unique_graphs"]


def _assert_no_graph_break():
    assert not counters["graph_break"], dict(counters["graph_break"])


def _assert_same(got, expected):
    torch.testing.assert_close(got, expected, **TIGHT)


def _run_loss_steps(fn, backend, normalizer, *, linear=False, mark=False, dynamic=None, shapes=SHAPES, config=CONFIG):
    """Run ``fn`` eagerly and compiled (``fullgraph=True``, ``aot_eager``) over ``shapes``; compare loss,
    metrics and gradients (of the logits, or of hidden and weight); return the number of graphs. ``config``: the
    config of every step, or a list of one per step."""
    _fresh()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter, dynamic=dynamic)
    weight = _weight()
    for i, (batch, length) in enumerate(shapes):
        x, t, a, m, old, ref, n = _step_inputs(i, batch, length, normalizer, linear=linear)
        results = []
        for f in (fn, compiled):
            leaves = [x.clone().requires_grad_(True)] + ([weight.clone().requires_grad_(True)] if linear else [])
            args = (t, a, m, old, ref)
            if mark and f is compiled:
                _mark_dynamic(leaves[0], *args)
            loss, metrics = f(*leaves, *args, n, backend, config[i] if isinstance(config, list) else config)
            loss.backward()
            results.append((loss, metrics, [leaf.grad for leaf in leaves]))
        (e_loss, e_met, e_grads), (c_loss, c_met, c_grads) = results
        _assert_same(c_loss, e_loss)
        assert c_met.keys() == e_met.keys()
        for k in e_met:
            _assert_same(c_met[k], e_met[k])
        for c_grad, e_grad in zip(c_grads, e_grads):
            _assert_same(c_grad, e_grad)
    _assert_no_graph_break()
    return _graphs()


def _policy(x, t, a, m, old, ref, n, backend, config):
    out = fused_rl.policy_loss(x, t, a, m, old_logprobs=old, ref_logprobs=ref, config=config, token_normalizer=n,
                               backend=backend)
    return out.loss, out.metrics


def _policy_inplace(x, t, a, m, old, ref, n, backend, config):
    """``inplace=True`` over a non-leaf buffer (a model's output): the gradient written over it."""
    out = fused_rl.policy_loss(x * 1.0, t, a, m, old_logprobs=old, ref_logprobs=ref, config=config, token_normalizer=n,
                               backend=backend, inplace=True)
    return out.loss, out.metrics


def _linear_policy(h, w, t, a, m, old, ref, n, backend, config):
    out = fused_rl.linear_policy_loss(h, w, t, a, m, old_logprobs=old, ref_logprobs=ref, config=config,
                                      token_normalizer=n, backend=backend)
    return out.loss, out.metrics


# ------------------------------------------------------------------------------------------------ policy_loss


@pytest.mark.parametrize("normalizer", ["float", "tensor", "int", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_automatic_dynamic(backend, normalizer):
    """Six steps, new B / T / advantages / normalizer each: the first graph is static, the second symbolic in
    all of them, no third."""
    assert _run_loss_steps(_policy, backend, normalizer) <= 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_two_pass_config_automatic_dynamic(backend):
    """gspo (the two-pass composition over the backend's token_logprobs) with a float normalizer."""
    assert _run_loss_steps(_policy, backend, "float", config=GSPO) <= 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_marked_dynamic_tensor_normalizer_one_graph(backend):
    """B and T marked dynamic, the normalizer a 0-dim tensor: one graph for every step."""
    assert _run_loss_steps(_policy, backend, "tensor", mark=True) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_marked_dynamic_float_normalizer(backend):
    """B and T marked dynamic, a Python-float normalizer: its first value is specialized (torch's automatic
    dynamic for scalars), the second makes it symbolic: two graphs, not six."""
    assert _run_loss_steps(_policy, backend, "float", mark=True) <= 2


@pytest.mark.parametrize("normalizer", ["float", "tensor"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_dynamic_true_one_graph(backend, normalizer):
    assert _run_loss_steps(_policy, backend, normalizer, dynamic=True) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_normalizer_same_shape_not_a_constant(backend):
    """Same shape every step, only the Python-float normalizer changes: two graphs for six values."""
    shapes = [(2, 5)] * 6
    assert _run_loss_steps(_policy, backend, "float", shapes=shapes) <= 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_specialized_floats_want_a_tensor_normalizer(backend):
    """With ``specialize_float = True`` (torch < 2.6's default) a Python float is a constant of the graph: one
    graph per value (torch's behaviour, not fused_rl's); a 0-dim tensor normalizer still compiles once."""
    shapes = [(2, 5)] * 4
    with torch._dynamo.config.patch(specialize_float=True):  # not monkeypatch: its undo deletes the option
        assert _run_loss_steps(_policy, backend, "float", shapes=shapes) == len(shapes)
        assert _run_loss_steps(_policy, backend, "tensor", shapes=shapes) == 1


# ------------------------------------------------------------------------------------------ linear_policy_loss


@pytest.mark.parametrize("normalizer", ["float", "tensor"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_policy_loss_automatic_dynamic(backend, normalizer):
    assert _run_loss_steps(_linear_policy, backend, normalizer, linear=True) <= 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_policy_loss_marked_dynamic_one_graph(backend):
    assert _run_loss_steps(_linear_policy, backend, "tensor", linear=True, mark=True) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_policy_loss_dynamic_true_float_normalizer_one_graph(backend):
    assert _run_loss_steps(_linear_policy, backend, "float", linear=True, dynamic=True) == 1


#: TRL's vLLM correction at its defaults: a sequence-level one, folded into the advantages on the tiled route
VLLM_IS = PolicyLossConfig(rollout_is="sequence_mask", rollout_is_max=3.0, kl="k3", beta=0.04)


def _policy_rollout(*args):
    """:func:`_policy` (logits) or :func:`_linear_policy` (hidden states and weight), with rollout log-probs between
    the old and reference ones (derived, so each step's inputs are its own) where the config reads them."""
    *lead, t, a, m, old, ref, n, backend, config = args
    fn = fused_rl.linear_policy_loss if len(lead) == 2 else fused_rl.policy_loss
    rollout = 0.5 * (old + ref) if config.uses_rollout_logprobs else None
    out = fn(*lead, t, a, m, old_logprobs=old, ref_logprobs=ref, config=config, rollout_logprobs=rollout,
             token_normalizer=n, backend=backend)
    return out.loss, out.metrics


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_policy_loss_sequence_rollout_correction(backend, dynamic):
    """TRL's vLLM correction on the tiled route, whose kernel runs the config without the correction (its literal
    formed at the config's construction): one graph under ``dynamic=True``."""
    graphs = _run_loss_steps(_policy_rollout, backend, "float", linear=True, dynamic=dynamic, config=VLLM_IS)
    assert graphs == 1 if dynamic else graphs <= 2


# -------------------------------------------------------------------- a config whose floats change every step

#: config kind -> (its fields, the floats a schedule changes every step): each float of PolicyLossConfig is in one
#: (``test_every_config_float_is_scheduled``), on the single-pass epilogue (cpu / triton), the two passes over
#: token_logprobs (gspo / gmpo / vespo, the masks) and TRL's vLLM correction (its sequence-level weights folded
#: into the advantages on the tiled route, the kernel config ``literal_without_rollout``)
SCHEDULES = {
    "ppo-kl": (dict(kl="k3", beta=0.04, entropy_coef=0.01),
               ("beta", "clip_low", "clip_high", "entropy_coef", "temperature")),
    "dual-clip-delta": (dict(dual_clip=3.0, delta=2.0), ("dual_clip", "delta")),
    "sapo": (dict(policy_loss="sapo"), ("sapo_temperature_pos", "sapo_temperature_neg")),
    "cispo": (dict(policy_loss="cispo", clip_high=4.0), ("clip_high",)),
    "gspo": (dict(policy_loss="gspo", kl="k3", beta=0.04, clip_low=3e-4, clip_high=4e-4),
             ("beta", "clip_low", "clip_high", "temperature")),
    "gmpo": (dict(policy_loss="gmpo"), ("clip_low", "clip_high")),
    "vespo": (dict(policy_loss="vespo"), ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")),
    "token-rollout": (dict(rollout_is="token_truncate", rollout_is_min=0.5), ("rollout_is_min", "rollout_is_max")),
    "sequence-rollout": (dict(rollout_is="sequence_mask", rollout_is_max=3.0, kl="k3", beta=0.04),
                         ("rollout_is_max", "beta")),
    "off-policy-mask": (dict(off_policy_mask=0.05), ("off_policy_mask",)),
    "top-entropy": (dict(top_entropy_quantile=0.5), ("top_entropy_quantile",)),
    "openrlhf-kl": (dict(kl="k2+", beta=0.04, kl_clamp=0.5, kl_is_clip=1.1), ("beta", "kl_clamp", "kl_is_clip")),
    "dppo": (dict(policy_loss="dppo_kl", clip_low=0.01, clip_high=0.02, delta=2.0), ("clip_low", "clip_high", "delta")),
    "kl-cov": (dict(cov_mode="kl_cov", cov_ratio=0.2), ("cov_ratio", "kl_cov_coef")),
    # cov_ratio 1: every candidate dropped, no random draw for eager and compiled to make differently
    "clip-cov": (dict(cov_mode="clip_cov", cov_ratio=1.0, clip_cov_lb=-1.0, clip_cov_ub=2.0),
                 ("clip_cov_lb", "clip_cov_ub")),
}
SAME_SHAPE = [(2, 5)] * 5


def _schedule(kind, steps):
    """One config a step of ``SCHEDULES[kind]``, each of its floats ``x (1 + 0.03 i)`` at step ``i`` (an adaptive
    KL controller's ``beta``, a clip or temperature schedule); nothing structural changes."""
    fields, floats = SCHEDULES[kind]
    base = PolicyLossConfig(**fields)
    return [base.replace(**{name: getattr(base, name) * (1.0 + 0.03 * i) for name in floats}) for i in range(steps)]


def test_every_config_float_is_scheduled():
    from fused_rl.config import FLOAT_FIELDS

    assert {name for _, floats in SCHEDULES.values() for name in floats} == set(FLOAT_FIELDS)


#: Python arithmetic on a config float inside a custom op's body, which runs eagerly (dynamo does not trace it)
ARITHMETIC_IN_OPS = {("fused_rl/backends/native.py", "1.0 / config.temperature"),
                     ("fused_rl/backends/torch_linear.py", "1.0 / config.temperature")}


def _config_float_arithmetic(source: str, float_fields) -> set:
    """The expressions of ``source`` that do Python arithmetic on a config float: a unary operator on ``x.<float
    field>``, or a binary one between it and a number or another such field; a local name bound to a field
    (``q = config.top_entropy_quantile``, ``lo, hi = c.rollout_is_min, c.rollout_is_max``, an annotated assignment,
    a conditional of fields and numbers, or another such name) counts as the field in its function."""
    import ast

    def bindings(node):
        """``(name, value)`` pairs an assignment makes (tuple targets matched with tuple values)."""
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Name):
                yield target.id, node.value
            elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                yield from ((t.id, v) for t, v in zip(target.elts, node.value.elts) if isinstance(t, ast.Name))

    def bound_names(function):
        pairs = [pair for node in ast.walk(function) if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value
                 for pair in bindings(node)]
        names: set = set()
        while True:  # to a fixed point: a name bound to such a name is one too
            more = {name for name, value in pairs if is_float(value, names)} - names
            if not more:
                return names
            names |= more

    def is_float(node, names):
        if isinstance(node, ast.IfExp):
            return is_number(node.body, names) and is_number(node.orelse, names) and (
                is_float(node.body, names) or is_float(node.orelse, names))
        return (isinstance(node, ast.Attribute) and node.attr in float_fields) or (
            isinstance(node, ast.Name) and node.id in names)

    def is_number(node, names):
        return is_float(node, names) or isinstance(node, ast.Constant) and isinstance(node.value, (int, float))

    tree = ast.parse(source)
    scopes = [(tree, set())] + [(f, bound_names(f)) for f in ast.walk(tree)
                                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    found = set()
    for scope, names in scopes:
        for node in ast.walk(scope):
            if (isinstance(node, ast.UnaryOp) and is_float(node.operand, names)) or (
                    isinstance(node, ast.BinOp) and (is_float(node.left, names) or is_float(node.right, names))
                    and is_number(node.left, names) and is_number(node.right, names)):
                found.add(ast.unparse(node))
    return found


def test_no_python_arithmetic_on_config_floats():
    """The traced code does arithmetic on a config float only as a tensor (``loss_math.config_scalar``): torch 2.11
    (the GPU image's) specializes a float that Python arithmetic touches first (``1.0 - config.clip_low``,
    ``-config.clip_low``), a new graph per value, which ``test_config_floats_changed_every_step_are_not_a_graph_per_
    value`` shows only on such a torch (2.13 traces it: measured, 5 graphs on 2.11, 2 on 2.13, for the ppo-kl,
    cispo, gspo, gmpo and top-entropy schedules). So this reads the package's source for the pattern
    (``_config_float_arithmetic``)."""
    import pathlib

    from fused_rl.config import FLOAT_FIELDS

    root = pathlib.Path(fused_rl.__file__).parent
    found = {(path.relative_to(root.parent).as_posix(), expression) for path in sorted(root.rglob("*.py"))
             for expression in _config_float_arithmetic(path.read_text(), FLOAT_FIELDS)}
    assert found == ARITHMETIC_IN_OPS


@pytest.mark.parametrize("source, expected", [
    ("def f(c, t):\n    return t * (1.0 - c.clip_low)", {"1.0 - c.clip_low"}),
    ("def f(c, t):\n    return t < -c.clip_low", {"-c.clip_low"}),
    ("def f(c, t):\n    q = c.top_entropy_quantile\n    return t.quantile(1 - q)", {"1 - q"}),
    ("def f(c, t):\n    b = c.beta if c.kl else 0.0\n    return t * (b * 2)", {"b * 2"}),
    ("def f(c, t):\n    q = c.top_entropy_quantile\n    return t * q + t < c.clip_high", set()),
    ("def f(c, t):\n    return t * -config_scalar(t, c.clip_low)", set()),
    ("def f(q):\n    return 1 - q\ndef g(c):\n    q = c.beta\n    return q", set()),
    ("def f(c, t):\n    lo, hi = c.clip_low, c.clip_high\n    return t < 1.0 / hi", {"1.0 / hi"}),
    ("def f(c, t):\n    q: float = c.beta\n    b = q\n    return t * -b", {"-b"}),
])
def test_the_config_float_check_finds_the_pattern(source, expected):
    """The source check of ``test_no_python_arithmetic_on_config_floats`` on snippets: the patterns torch 2.11
    specializes (through a local name too), not tensor arithmetic, and a name only in the function that binds it."""
    assert _config_float_arithmetic(source, {"clip_low", "clip_high", "beta", "top_entropy_quantile"}) == expected


@pytest.mark.parametrize("linear", [False, True], ids=["policy_loss", "linear_policy_loss"])
@pytest.mark.parametrize("kind", list(SCHEDULES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_config_floats_changed_every_step_are_not_a_graph_per_value(backend, kind, linear):
    """Five steps of one shape, every float of the config new each step: equal to eager, and two graphs (the first
    value's, then one where the floats are symbolic), not five. The custom ops took the config as one string, floats
    included, so each new value was a new graph, and past torch.compile's recompile limit (8) the step ran eagerly
    (``fullgraph=True``: raised). Now they take its structure as the string and its floats as a host tensor
    (``custom_ops.config_args``)."""
    graphs = _run_loss_steps(_policy_rollout, backend, "tensor", linear=linear, shapes=SAME_SHAPE,
                             config=_schedule(kind, len(SAME_SHAPE)))
    assert graphs <= 2


@pytest.mark.parametrize("linear", [False, True], ids=["policy_loss", "linear_policy_loss"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_config_floats_changed_every_step_dynamic_true_one_graph(backend, linear):
    """The same under ``dynamic=True``: the floats are symbolic from the first call, one graph."""
    graphs = _run_loss_steps(_linear_policy if linear else _policy, backend, "tensor", linear=linear, dynamic=True,
                             shapes=SAME_SHAPE, config=_schedule("ppo-kl", len(SAME_SHAPE)))
    assert graphs == 1


@pytest.mark.skipif(not HAS_TRITON, reason=str(AVAILABLE["triton"]))
@pytest.mark.parametrize("linear", [False, True], ids=["policy_loss", "linear_policy_loss"])
def test_triton_config_floats_changed_every_step(linear):
    """The Triton kernels (interpreter), three tiny steps: two graphs, not three."""
    graphs = _run_loss_steps(_linear_policy if linear else _policy, "triton", "tensor", linear=linear,
                             shapes=[(2, 3)] * 3, config=_schedule("ppo-kl", 3))
    assert graphs <= 2


# ------------------------------------------------------------------------------- token_logprobs (and linear)


def _run_logprob_steps(backend, linear, *, mark=False, dynamic=None, shapes=SHAPES, temperatures=None):
    """As :func:`_run_loss_steps` for ``token_logprobs`` / ``linear_token_logprobs`` (log-probs, entropies and
    gradients); the temperature is a constant of the step (0.7) or, with ``temperatures``, the step's argument."""
    _fresh()

    def fn(*args, **kwargs):
        temperature = kwargs.get("temperature", 0.7)  # a literal: a constant of the graph, also under dynamic=True
        if linear:
            h, w, t = args
            logp, ent = fused_rl.linear_token_logprobs(h, w, t, temperature=temperature, return_entropy=True,
                                                       backend=backend)
        else:
            x, t = args
            logp, ent = fused_rl.token_logprobs(x, t, temperature=temperature, return_entropy=True, backend=backend)
        return (1.5 * logp).sum() - 0.5 * ent.sum(), logp.detach(), ent.detach()

    compiled = torch.compile(fn, fullgraph=True, backend=CompileCounterWithBackend("aot_eager"), dynamic=dynamic)
    weight = _weight()
    for i, (batch, length) in enumerate(shapes):
        x, t, *_ = _step_inputs(i, batch, length, "none", linear=linear)
        t[0, -1] = fused_rl.IGNORE_INDEX
        kwargs = {} if temperatures is None else dict(temperature=temperatures[i])
        results = []
        for f in (fn, compiled):
            leaves = [x.clone().requires_grad_(True)] + ([weight.clone().requires_grad_(True)] if linear else [])
            if mark and f is compiled:
                _mark_dynamic(leaves[0], t)
            out = f(*leaves, t, **kwargs)
            out[0].backward()
            results.append((out, [leaf.grad for leaf in leaves]))
        (e_out, e_grads), (c_out, c_grads) = results
        for got, expected in zip(c_out + tuple(c_grads), e_out + tuple(e_grads)):
            _assert_same(got, expected)
    _assert_no_graph_break()
    return _graphs()


@pytest.mark.parametrize("linear", [False, True], ids=["token_logprobs", "linear_token_logprobs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_automatic_dynamic(backend, linear):
    assert _run_logprob_steps(backend, linear) <= 2


@pytest.mark.parametrize("linear", [False, True], ids=["token_logprobs", "linear_token_logprobs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_marked_dynamic_one_graph(backend, linear):
    assert _run_logprob_steps(backend, linear, mark=True) == 1


@pytest.mark.parametrize("linear", [False, True], ids=["token_logprobs", "linear_token_logprobs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_dynamic_true_constant_temperature_one_graph(backend, linear):
    """``dynamic=True`` with the temperature a literal of the step (a constant of the graph)."""
    assert _run_logprob_steps(backend, linear, dynamic=True) == 1


# ------------------------------------------------------------------------------------- triton (interpreter)

TRITON_SHAPES = [(2, 3), (3, 2)]


@pytest.mark.skipif(not HAS_TRITON, reason=str(AVAILABLE["triton"]))
@pytest.mark.parametrize("normalizer", ["float", "tensor"])
def test_triton_policy_loss_marked_dynamic(normalizer):
    """Two tiny steps (interpreter): one graph with a tensor normalizer, at most two with a float."""
    graphs = _run_loss_steps(_policy, "triton", normalizer, mark=True, shapes=TRITON_SHAPES)
    assert graphs == 1 if normalizer == "tensor" else graphs <= 2


@pytest.mark.skipif(not HAS_TRITON, reason=str(AVAILABLE["triton"]))
def test_triton_linear_policy_loss_dynamic_true_one_graph():
    assert _run_loss_steps(_linear_policy, "triton", "float", linear=True, dynamic=True, shapes=TRITON_SHAPES) == 1


@pytest.mark.skipif(not HAS_TRITON, reason=str(AVAILABLE["triton"]))
@pytest.mark.parametrize("linear", [False, True], ids=["token_logprobs", "linear_token_logprobs"])
def test_triton_token_logprobs_marked_dynamic_one_graph(linear):
    assert _run_logprob_steps("triton", linear, mark=True, shapes=TRITON_SHAPES) == 1


# --------------------------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize("linear", [False, True], ids=["policy_loss", "linear_policy_loss"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float_normalizer_is_a_graph_input_not_a_host_read(backend, linear):
    """Once symbolic, a Python-float normalizer enters the forward graph as a 0-dim tensor input (torch's
    tensorified scalar): no ``.item()`` (``_local_scalar_dense``, a device sync on CUDA) in the forward or
    backward graph of any step."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    _fresh()
    fn = _linear_policy if linear else _policy
    # inductor's partitioner (torch 2.8's default one fails an assertion on a custom op's tuple output)
    backend_fn = aot_autograd(fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition)
    compiled = torch.compile(fn, fullgraph=True, backend=backend_fn)
    weight = _weight()
    for i, (batch, length) in enumerate(SHAPES[:3]):
        x, *args = _step_inputs(i, batch, length, "float", linear=linear)
        leaves = [x.requires_grad_(True)] + ([weight.requires_grad_(True)] if linear else [])
        compiled(*leaves, *args, backend, CONFIG)[0].backward()
    assert _graphs() == 2 and len(graphs) == 4  # forward and backward of the static and the symbolic graph
    reads = [str(node.target) for gm in graphs for node in gm.graph.nodes
             if node.op == "call_function" and "local_scalar_dense" in str(node.target)]
    assert not reads
    fw_inputs = [node.meta.get("val") for node in graphs[2].graph.nodes if node.op == "placeholder"]
    assert any(isinstance(v, torch.Tensor) and v.dim() == 0 for v in fw_inputs)


# ------------------------------------------------------ validation on symbolic values (the temperature, strides)

@pytest.mark.parametrize("linear", [False, True], ids=["token_logprobs", "linear_token_logprobs"])
def test_temperature_argument_under_dynamic_true(linear):
    """A fixed temperature passed to the compiled step, ``dynamic=True``: one graph (``check_temperature``'s
    ``math.isfinite`` on the symbolic float broke ``fullgraph``; it compares now)."""
    assert _run_logprob_steps("torch", linear, dynamic=True, shapes=SHAPES[:3], temperatures=[0.7] * 3) == 1


@pytest.mark.parametrize("linear", [False, True], ids=["token_logprobs", "linear_token_logprobs"])
def test_new_temperature_traces(linear):
    """A new temperature each step: equal to eager, and two graphs for four values (the custom ops take it as a
    host tensor, ``custom_ops.host_floats``; as a ``float`` argument it was a new graph per value)."""
    assert _run_logprob_steps("torch", linear, shapes=[(2, 5)] * 4, temperatures=[0.7, 0.8, 0.9, 1.1]) <= 2


def _traced_raise(message: str) -> str:
    """The error of a ``raise`` dynamo traced under ``fullgraph=True``: torch 2.11 and 2.13 keep the exception's
    message; 2.8's reports "Observed exception" instead (its user stack names the call; 2.9 and 2.10 not checked)."""
    from torch.torch_version import TorchVersion

    return message if TorchVersion(torch.__version__) >= (2, 11) else f"{message}|Observed exception"


@pytest.mark.parametrize("linear", [False, True], ids=["token_logprobs", "linear_token_logprobs"])
def test_numpy_scalar_temperature_argument_of_a_compiled_step(linear):
    """A numpy-float temperature passed to a compiled step: dynamo traces it as an ``ndarray`` of unknown value (its
    float is data-dependent, which no check can compare), so ``fullgraph=True`` raises saying to pass a Python float
    (it raised ``repr() on tensor``); without ``fullgraph`` dynamo runs the call eagerly, where it is accepted."""
    h, t, *_ = _step_inputs(0, 2, 5, "none", linear=linear)
    args = (h, _weight(), t) if linear else (torch.randn(2, 5, VOCAB), t)
    fn = fused_rl.linear_token_logprobs if linear else fused_rl.token_logprobs
    expected = fn(*args, temperature=0.7, backend="torch")
    _fresh()
    with pytest.raises(Exception, match=_traced_raise("pass a Python float")):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(*args, temperature=np.float64(0.7), backend="torch")
    got = torch.compile(fn, backend="aot_eager")(*args, temperature=np.float64(0.7), backend="torch")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_numpy_bool_flag_in_a_compiled_step():
    """A numpy bool flag (accepted eagerly) in a ``fullgraph=True`` step: traced as an array of unknown value, it
    raises saying to pass a Python bool (it raised ``repr() on tensor``)."""
    x, t, a, m, *_ = _step_inputs(0, 2, 5, "none")
    step = lambda x: fused_rl.policy_loss(x, t, a, m, compute_entropy=np.bool_(True), backend="torch").loss  # noqa
    _fresh()
    with pytest.raises(Exception, match=_traced_raise("pass a Python bool")):
        torch.compile(step, fullgraph=True, backend="aot_eager")(x)


def test_liger_module_numpy_temperature_traces():
    """``FusedLinearGRPOLoss(temperature=np.float32(0.7))`` with ``ref_input``: the reference pass took the numpy
    attribute into the compiled step (an ``ndarray`` there); the module keeps its float, as it does ``beta``'s."""
    from fused_rl.nn import FusedLinearGRPOLoss

    h, t, a, m, *_ = _step_inputs(0, 2, 5, "none", linear=True)
    w = _weight()
    loss_fn = FusedLinearGRPOLoss(beta=0.04, temperature=np.float32(0.7))
    step = lambda h: loss_fn(h, w, t, m, a, ref_input=0.9 * h.detach(), ref_weight=w)[0]  # noqa: E731
    _fresh()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(h)
    _assert_same(got, step(h))
    assert loss_fn.temperature == pytest.approx(0.7) and type(loss_fn.temperature) is float


@pytest.mark.parametrize("setting, values, graphs", [("beta", [0.04, 0.05, 0.0, 0.06, 0.07], 3),
                                                     ("temperature", [1.0, 0.9, 0.8, 0.7], 2)])
def test_liger_module_setting_changed_between_compiled_steps(setting, values, graphs):
    """``FusedLinearGRPOLoss`` with a setting assigned between compiled steps (an adaptive KL controller's ``beta``, a
    temperature schedule): equal to eager, and not a graph per value: the first value's graph, then one where the
    float is symbolic (beta 0 is a third: the module drops its KL term there). The config was rebuilt lazily inside
    ``forward``, i.e. in the traced step, where the changed float is symbolic: ``fullgraph=True`` raised at the second
    value; then the custom ops took the config's floats in a string, a new graph per value."""
    from fused_rl.nn import FusedLinearGRPOLoss

    _fresh()
    eager_fn, compiled_fn = FusedLinearGRPOLoss(), FusedLinearGRPOLoss()
    compiled = torch.compile(lambda *args: compiled_fn(*args), fullgraph=True,
                             backend=CompileCounterWithBackend("aot_eager"))
    weight = _weight()
    for i, value in enumerate(values):
        setattr(eager_fn, setting, value)
        setattr(compiled_fn, setting, value)
        h, t, a, m, old, ref, _ = _step_inputs(i, 2, 5, "none", linear=True)
        results = []
        for f in (eager_fn, compiled):
            leaves = [h.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
            loss, metrics = f(*leaves, t, m, a, None, ref, old)
            loss.backward()
            results.append([loss, *metrics, *(leaf.grad for leaf in leaves)])
        assert len(results[0]) == len(results[1])
        for got, expected in zip(results[1], results[0]):
            _assert_same(got, expected)
    _assert_no_graph_break()
    assert _graphs() == graphs


def test_numpy_scalar_normalizer_traces():
    """A numpy-float normalizer (a ``numbers.Real`` eagerly) under ``fullgraph=True``: dynamo traces it as an
    ``ndarray``, which ``prepare_policy_inputs`` refused (and formatting the error broke the graph); it takes it as
    a tensor now."""
    assert _run_loss_steps(_policy, "torch", "numpy", shapes=[(2, 5)] * 3) <= 2


#: ``inplace=True`` with dynamic shapes (marked, ``dynamic=True`` or after the first new length): ``policy_loss``'s
#: ``validation.check_rows_disjoint`` ordered the leading dimensions with ``sorted(..., key=stride)``, which dynamo
#: refuses on symbolic strides (``Unsupported: sort with non-constant keys``); an insertion sort now, traced as guards.
@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_automatic_dynamic(backend):
    assert _run_loss_steps(_policy_inplace, backend, "float") <= 2


@pytest.mark.skipif(not HAS_TRITON, reason=str(AVAILABLE["triton"]))
def test_triton_inplace_marked_dynamic_one_graph():
    """``inplace=True`` on triton (the gradient written over the logits buffer, a mutating custom op)."""
    assert _run_loss_steps(_policy_inplace, "triton", "tensor", mark=True, shapes=TRITON_SHAPES) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_static_shapes(backend):
    """``inplace=True`` with the shape of every step the same (only the normalizer and the
    advantages change) compiles twice (static float, then symbolic) and matches eager."""
    assert _run_loss_steps(_policy_inplace, backend, "float", shapes=[(2, 5)] * 4) <= 2


@pytest.mark.parametrize("name, dtype, expect", [("cuda", torch.float32, "cuda"), ("auto", torch.float64, None)])
def test_backend_selection_traces_on_cuda(monkeypatch, name, dtype, expect):
    """``get_backend`` runs inside the compiled step: the cuda backend's device count (a pybind call dynamo cannot
    trace) is a trace-time constant; ``"auto"`` reaches it for the dtypes triton lacks (fp64)."""
    from fused_rl.backends import _REGISTRY, get_backend, native

    if "cuda" not in _REGISTRY:
        pytest.skip("fused_rl._C was built without its CUDA kernels")
    # as on a machine with a GPU, and as opaque to dynamo as the pybind function
    monkeypatch.setattr(native._C, "cuda_device_count", torch.compiler.disable(lambda: 1))
    chosen = []

    def step(x):
        chosen.append(get_backend(name, torch.device("cuda"), dtype).name)
        return x + 1

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2))
    assert chosen[-1] == (expect or get_backend(name, torch.device("cuda"), dtype).name)


def test_a_preset_built_inside_the_compiled_step_traces():
    """``PolicyLossConfig.preset`` inside a ``fullgraph`` step: its field check read ``dataclasses.fields``, which
    dynamo does not trace; a constant config, as the constructor's."""
    g = torch.Generator().manual_seed(0)
    x, targets = torch.randn(2, 5, 17, generator=g), torch.randint(0, 17, (2, 5), generator=g)
    adv, mask = torch.randn(2, generator=g), torch.ones(2, 5, dtype=torch.bool)

    def step(logits):
        return fused_rl.policy_loss(logits, targets, adv, mask, config=PolicyLossConfig.preset("dapo"),
                                    backend="torch").loss

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, step(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_config_built_inside_the_compiled_step_from_changing_floats(backend):
    """``PolicyLossConfig(beta=b, clip_high=c, temperature=tau)`` built inside a ``fullgraph`` step from the step's
    float arguments, new each step: two graphs, equal to eager. The validation's ``math.isfinite`` on the second
    value (symbolic) broke the graph (``torch.* op returned non-Tensor``); it compares now, so an invalid value is
    still refused (a guard fails, the retrace raises)."""
    def step(x, t, a, m, old, ref, n, beta, clip, tau):
        config = PolicyLossConfig(kl="k3", beta=beta, clip_high=clip, temperature=tau, dual_clip=3.0)
        return _policy(x, t, a, m, old, ref, n, backend, config)

    _fresh()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for i, floats in enumerate([(0.04, 0.2, 1.0), (0.05, 0.3, 0.9), (0.06, 0.25, 0.8), (0.07, 0.22, 0.7)]):
        x, t, a, m, old, ref, n = _step_inputs(i, 2, 5, "tensor")
        (got, got_metrics), (expected, expected_metrics) = compiled(x, t, a, m, old, ref, n, *floats), \
            step(x, t, a, m, old, ref, n, *floats)
        _assert_same(got, expected)
        for k in expected_metrics:
            _assert_same(got_metrics[k], expected_metrics[k])
    _assert_no_graph_break()
    assert _graphs() == 2
    with pytest.raises(Exception):  # fullgraph: torch's error for the raise it traced (its wording varies)
        compiled(x, t, a, m, old, ref, n, -1.0, 0.2, 1.0)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        torch.compile(step, backend="aot_eager")(x, t, a, m, old, ref, n, -1.0, 0.2, 1.0)


CUDA_AVAILABLE = fused_rl.available_backends(torch.device("cuda")) if torch.cuda.is_available() else {}


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("linear", [False, True], ids=["policy_loss", "linear_policy_loss"])
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_config_schedule_under_inductor(backend, linear, mode):
    """On the GPU, under ``torch.compile`` (inductor): a config whose floats change every step is two graphs, equal
    to eager; the floats' host tensor is built by a CPU kernel inside the compiled graph (the ops read it on the host:
    no sync). Under ``mode="reduce-overhead"`` (CUDA graphs: recorded at the second call of a graph, replayed from the
    third) too: the ops read their floats on the host, so they carry ``cudagraph_unsafe`` and run outside the
    recorded graphs; a replay of a recorded op would repeat the recorded floats, not the step's."""
    if CUDA_AVAILABLE.get(backend, "no CUDA device") is not None:
        pytest.skip(str(CUDA_AVAILABLE.get(backend, "no CUDA device")))
    fn = _linear_policy if linear else _policy
    _fresh()
    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    weight = _weight().cuda()
    for i, config in enumerate(_schedule("ppo-kl", 6)):
        x, t, a, m, old, ref, n = (v.cuda() for v in _step_inputs(i, 4, 64, "tensor", linear=linear))
        results = []
        for f in (fn, compiled):
            leaves = [x.clone().requires_grad_(True)] + ([weight.clone().requires_grad_(True)] if linear else [])
            loss, metrics = f(*leaves, t, a, m, old, ref, n, backend, config)
            loss.backward()
            results.append([loss, *metrics.values(), *(leaf.grad for leaf in leaves)])
        for got, expected in zip(*results[::-1]):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    _assert_no_graph_break()
    assert _graphs() <= 2
