"""Build script: package metadata lives in pyproject.toml; this file only declares the csrc/ extension.

Until the C++/CUDA kernels land, no extension is built and the package is pure Python.
"""

from setuptools import setup

setup()
