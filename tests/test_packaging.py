"""The package's layout does not leak into other packages' import names.

``kernels/`` sits at the repository root (the design card's layout) and is imported as
``fused_rl.kernels`` through the link ``fused_rl/kernels -> ../kernels``. Hugging Face also ships a
package named ``kernels``, which transformers >= 5.25 imports at start-up; with the repository root on
``sys.path`` (``python -m`` from the checkout, ``PYTHONPATH=.``, torchrun workers) a *regular* package
there would shadow it and break ``import transformers`` (the CI failure of a DDP test). The folder is
therefore a namespace package, which loses to any installed regular package of that name.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_from_root(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_top_level_kernels_folder_is_not_a_regular_package():
    assert not (ROOT / "kernels" / "__init__.py").exists(), (
        "kernels/__init__.py makes the repository root shadow Hugging Face's `kernels` package")
    assert (ROOT / "fused_rl" / "kernels" / "logits.py").is_file()


def test_triton_kernel_modules_import_as_fused_rl_kernels():
    proc = _run_from_root("import fused_rl.kernels.epilogue as e, fused_rl.kernels.logits as l; "
                          "print(e.__file__); print(l.__file__)")
    if proc.returncode != 0 and "No module named 'triton" in proc.stderr:
        pytest.skip("triton is not installed")
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.split():
        assert Path(line).resolve().parent == (ROOT / "kernels").resolve()


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None
                    or importlib.util.find_spec("transformers") is None,
                    reason="Hugging Face's kernels / transformers not installed")
def test_root_on_sys_path_does_not_shadow_hf_kernels():
    proc = _run_from_root("import kernels, transformers.activations, fused_rl; print(kernels.__file__)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    origin = Path(proc.stdout.strip()).resolve()
    assert (ROOT / "kernels").resolve() not in origin.parents, origin


def test_sdist_carries_the_sources_and_the_test_suite(tmp_path):
    """The source distribution holds every tracked file of csrc/ (the CUDA kernels' .cu, compiled by setup.py
    outside the extension's sources: without it an sdist build is silently CPU-only), kernels/, tests/
    (the suite's helpers too), bench/ and docs/ (MANIFEST.in), and the license text (Apache-2.0 asks for it)."""
    import tarfile

    listed = subprocess.run(["git", "ls-files", "csrc", "kernels", "tests", "bench", "docs", "LICENSE"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0 or not listed.stdout.strip():
        pytest.skip("not a git checkout")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "FUSED_RL_CUDA": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = sorted(set(listed.stdout.split()) - names)
    assert not missing, missing
