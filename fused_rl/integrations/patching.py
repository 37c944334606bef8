"""Rebinding a peer's functions to fused_rl's in the modules that hold them (the ``patch_*`` functions of the verl
and Megatron adapters)."""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Optional


def rebind(replacements: dict[str, Callable], modules: Optional[tuple], default: tuple) -> dict:
    """Set each name of ``replacements`` in each module of ``modules`` that has it (modules not imported are left:
    one imported later takes the names from the first). ``modules=None``: ``default``, whose first module (the one the
    others import the names from) is imported. Returns ``{module name: {name: previous}}`` for restoring."""
    if modules is None:
        importlib.import_module(default[0])
        modules = default
    previous = {}
    for name in modules:
        module = sys.modules.get(name)
        if module is None:
            continue
        previous[name] = {attr: getattr(module, attr) for attr in replacements if hasattr(module, attr)}
        for attr in previous[name]:
            setattr(module, attr, replacements[attr])
    return previous
