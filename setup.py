"""Build script: package metadata lives in pyproject.toml; this file only declares the csrc/ extension.

``fused_rl._C`` (pybind11, no torch C++ ABI dependence):

* the CPU kernels are always attempted with ``g++ -O3 -fopenmp`` (baseline ``-march=x86-64-v2`` plus
  an AVX2+FMA copy chosen at run time, never ``-march=native``);
* the CUDA kernels are added when ``nvcc`` is found, or forced with ``FUSED_RL_CUDA=1``
  (``FUSED_RL_CUDA=0`` disables them); cudart is linked statically, code for sm_80 and sm_90
  (plus compute_90 PTX);
* a failed build is not fatal (the package falls back to its Triton / torch backends and
  ``python -m fused_rl.info`` says why) unless ``FUSED_RL_REQUIRE_NATIVE=1``.
"""

from __future__ import annotations

import glob
import os
import platform
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _log(msg: str) -> None:
    print(f"fused_rl setup: {msg}", file=sys.stderr, flush=True)


def _cuda_home(nvcc: str) -> str | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in candidates:
        if home and _cudart_dir(home):
            return home
    return None


def _cudart_dir(home: str) -> str | None:
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"), os.path.join("targets", "sbsa-linux", "lib")):
        d = os.path.join(home, sub)
        if os.path.exists(os.path.join(d, "libcudart_static.a")):
            return d
    return None


def _cuda_request() -> str:
    """'off', 'on' (forced) or 'auto'."""
    v = os.environ.get("FUSED_RL_CUDA", "").strip().lower()
    if v in ("0", "off", "false", "no"):
        return "off"
    if v in ("1", "on", "true", "yes"):
        return "on"
    return "auto"


NVCC_FLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
              "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_90,code=compute_90"]


class BuildExt(build_ext):
    """Compiles the .cu sources with nvcc first (when wanted), and never fails the install unless asked."""

    failed: set = set()

    def _built_only(self, method):
        exts = self.extensions
        self.extensions = [e for e in exts if e.name not in self.failed]
        try:
            return method()
        finally:
            self.extensions = exts

    def get_outputs(self):
        return self._built_only(super().get_outputs)

    def copy_extensions_to_source(self):
        return self._built_only(super().copy_extensions_to_source)

    def build_extension(self, ext):
        require = os.environ.get("FUSED_RL_REQUIRE_NATIVE", "") == "1"
        mode = _cuda_request()
        base = dict(sources=list(ext.sources), extra_objects=list(ext.extra_objects),
                    define_macros=list(ext.define_macros), libraries=list(ext.libraries),
                    library_dirs=list(ext.library_dirs))
        if mode != "off":
            nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
            try:
                if nvcc is None:
                    raise RuntimeError("nvcc not found on PATH")
                self._add_cuda(ext, nvcc)
                _log("building the CUDA kernels (sm_80, sm_90)")
            except Exception as exc:  # noqa: BLE001
                if mode == "on":
                    raise RuntimeError(f"FUSED_RL_CUDA=1 but the CUDA part cannot be built: {exc}") from exc
                _log(f"skipping the CUDA kernels: {exc}")
                for k, v in base.items():
                    setattr(ext, k, list(v))
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            if mode == "on":
                raise
            if ext.extra_objects != base["extra_objects"]:  # retry CPU-only (FUSED_RL_REQUIRE_NATIVE=1 too)
                _log(f"build with CUDA failed ({exc}); retrying CPU-only")
                for k, v in base.items():
                    setattr(ext, k, list(v))
                try:
                    super().build_extension(ext)
                    return
                except Exception as exc2:  # noqa: BLE001
                    exc = exc2
            if require:
                raise RuntimeError(f"FUSED_RL_REQUIRE_NATIVE=1 but fused_rl._C cannot be built: {exc}") from exc
            self.failed.add(ext.name)
            _log(f"WARNING: the native extension fused_rl._C was not built ({exc}); the 'cpu'/'cuda' "
                 "backends will be unavailable (the torch and triton backends still work)")

    def _add_cuda(self, ext, nvcc: str) -> None:
        home = _cuda_home(nvcc)
        if home is None:
            raise RuntimeError("libcudart_static.a not found (set CUDA_HOME)")
        os.makedirs(self.build_temp, exist_ok=True)
        objects = []
        for src in ("logits_cuda.cu",):
            obj = os.path.join(self.build_temp, src.replace(".cu", ".cu.o"))
            cmd = [nvcc, *NVCC_FLAGS, "-I", os.path.join(HERE, CSRC), "-c", os.path.join(HERE, CSRC, src), "-o", obj]
            _log(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        ext.extra_objects += objects
        ext.define_macros += [("FRL_WITH_CUDA", "1")]
        ext.library_dirs += [_cudart_dir(home)]
        ext.libraries += ["cudart_static", "rt", "pthread", "dl"]


def _extension() -> Extension:
    try:
        import pybind11
        includes = [pybind11.get_include()]
    except ImportError:  # metadata-only invocations
        includes = []
    sources = [f"{CSRC}/bindings.cpp", f"{CSRC}/logits_cpu.cpp"]
    cflags = ["-O3", "-std=c++17", "-fopenmp", "-fvisibility=hidden", "-Wno-psabi"]
    macros = []
    if IS_X86:
        cflags.append("-march=x86-64-v2")
        sources.append(f"{CSRC}/logits_cpu_avx2.cpp")
        macros.append(("FRL_HAVE_AVX2_TU", "1"))
    # the headers hold the kernels: an edit to one must rebuild the extension
    headers = sorted(glob.glob(f"{CSRC}/*.h"))
    return Extension("fused_rl._C", sources=sources, include_dirs=includes + [CSRC], define_macros=macros,
                     depends=headers, extra_compile_args=cflags, extra_link_args=["-fopenmp"], language="c++")


setup(license="Apache-2.0", ext_modules=[_extension()], cmdclass={"build_ext": BuildExt})
