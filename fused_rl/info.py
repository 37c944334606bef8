"""``python -m fused_rl.info``: versions, and which backends can run on cpu / cuda (and why not)."""

from __future__ import annotations

import importlib.metadata
import platform
import sys


def main() -> None:
    import torch

    import fused_rl
    from fused_rl.backends import available_backends
    from fused_rl.backends import native

    print(f"fused_rl {fused_rl.__version__} ({fused_rl.__file__})")
    print(f"python {platform.python_version()} on {platform.machine()}, torch {torch.__version__}"
          f" (CUDA {torch.version.cuda or 'none'}, {torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU)")
    for name in ("triton", "transformers", "trl", "liger_kernel"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{name}: {version}")
    C = native._C
    if C is None:
        print(f"native extension: not loaded: {native.LOAD_ERROR}")
    else:
        print(f"native extension: {C.__file__}; CPU kernels: {C.cpu_isa()}, {C.cpu_max_threads()} OpenMP threads; "
              f"CUDA kernels: {'built' if C.has_cuda else 'not built'}")
    for dev in ("cpu", "cuda"):
        print(f"backends on {dev}:")
        for name, reason in available_backends(torch.device(dev)).items():
            print(f"  {name:10s} {'available' if reason is None else 'unavailable: ' + reason}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
