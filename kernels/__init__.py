"""Triton kernels of fused_rl, installed as ``fused_rl.kernels`` (see README, "Layout").

Importing this package never requires Triton; the kernel modules do.
"""
