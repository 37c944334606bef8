"""Test session setup.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors: the variable must be set
before triton is first imported, so it is set here, for the whole session, unless a GPU is present.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
