"""Attention kernels (Triton) and their PyTorch reference implementations.

Empty until the compressed region lands (issue [radix_ext] / [gpu]).
"""
