"""Backend registry and selection.

``backend=`` accepts ``"auto"`` or a registered name. ``"auto"`` walks :data:`AUTO_ORDER` for the
tensor's device and takes the first available backend (never the reference); an explicitly named
backend that cannot run raises instead of silently falling back.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.autograd.forward_ad as fwAD

from .base import Backend
from .reference import ReferenceBackend
from .torch_chunked import TorchBackend

BACKEND_NAMES = ("auto", "reference", "torch", "triton", "cpu", "cuda")

#: Preference of ``backend="auto"`` per device type, fastest first.
AUTO_ORDER = {"cuda": ("triton", "cuda", "torch"), "cpu": ("cpu", "torch")}

_REGISTRY: dict[str, Backend] = {}
_MISSING: dict[str, str] = {}


def register(backend: Backend) -> None:
    _REGISTRY[backend.name] = backend
    _MISSING.pop(backend.name, None)


def register_missing(name: str, reason: str) -> None:
    """Record that ``name`` could not be loaded in this environment, and why."""
    if name not in _REGISTRY:
        _MISSING[name] = reason


def _load_optional() -> None:
    """Import the backends whose dependencies are optional; each registers itself or records why not."""
    import importlib

    for module in ("fused_rl.backends.triton", "fused_rl.backends.native"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # the module exists but a dependency is missing: it says which
                raise


register(ReferenceBackend())
register(TorchBackend())
_load_optional()
for _name in ("triton", "cpu", "cuda"):
    if _name not in _MISSING:  # keep the specific reason an optional module recorded
        register_missing(_name, f"backend {_name!r} is not built into this installation")


def _in_functorch_transform() -> bool:
    """Whether this call runs inside a ``torch.func`` transform (``grad``, ``vmap``, ...); never asked while
    ``torch.compile`` traces (where the custom ops are opaque calls)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def _has_forward_tangent(tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether one of ``tensors`` is a forward-mode AD dual (``torch.autograd.forward_ad.make_dual``), whose
    tangent a custom op would drop without a word (a ``None`` tangent of the outputs reads as zero)."""
    return (not torch.compiler.is_compiling() and fwAD._current_level >= 0
            and any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors))


def get_backend(name: str, device: torch.device, dtype: Optional[torch.dtype] = None,
                linear: bool = False, differentiable: Sequence[Optional[torch.Tensor]] = ()) -> Backend:
    """The backend to use for tensors on ``device`` (and of ``dtype``); ``linear`` asks for one that
    implements the fused-linear operations; ``differentiable``, the inputs the outputs are differentiated
    by, are checked for forward-mode AD tangents (only the reference propagates them)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name != "reference" and _in_functorch_transform():
        raise RuntimeError("the fused backends are torch.library custom ops without torch.func rules: inside "
                           "torch.func.grad, vmap, jacrev and the other torch.func transforms use backend='reference'")
    if name != "reference" and _has_forward_tangent(differentiable):
        raise RuntimeError("the fused backends are torch.library custom ops without forward-mode AD (jvp) rules: "
                           "for inputs with a tangent (torch.autograd.forward_ad.make_dual) use backend='reference'")
    if name == "auto":
        for candidate in AUTO_ORDER.get(device.type, ("torch",)):
            be = _REGISTRY.get(candidate)
            if be is not None and (dtype is None or dtype in be.dtypes) and (be.has_linear or not linear) \
                    and be.unavailable_reason(device) is None:
                return be
        name = "torch"  # the fallback, checked as if named: a dtype no backend takes is refused
    be = _REGISTRY.get(name)
    if be is None:
        raise RuntimeError(f"backend {name!r} is unavailable: {_MISSING.get(name, 'not registered')}")
    reason = be.unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"backend {name!r} cannot run on {device}: {reason}")
    if dtype is not None and dtype not in be.dtypes:
        raise ValueError(f"backend {name!r} does not support {dtype}; supported: {be.dtypes}")
    if linear and not be.has_linear:
        raise NotImplementedError(f"backend {name!r} has no fused-linear implementation; use 'torch' or 'auto'")
    return be


def available_backends(device="cpu") -> dict[str, Optional[str]]:
    """Every known backend name -> ``None`` if usable on ``device`` (a ``torch.device`` or a string such as
    ``"cuda"``), else the reason it is not."""
    device = torch.device(device)
    out: dict[str, Optional[str]] = {}
    for name in BACKEND_NAMES[1:]:
        be = _REGISTRY.get(name)
        out[name] = _MISSING.get(name, "not registered") if be is None else be.unavailable_reason(device)
    return out


__all__ = ["Backend", "BACKEND_NAMES", "AUTO_ORDER", "register", "register_missing", "get_backend",
           "available_backends"]
