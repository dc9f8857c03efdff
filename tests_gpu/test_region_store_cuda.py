"""The fused store of a decode step's new tokens (kernels/region_store.py)
compiled for the GPU, against its PyTorch form on the same device: the same
cases as tests/interpreted/test_region_store.py, at a 7B model's shapes too
(4 kv heads, head_dim 128, bf16 K/V into the region's dtype)."""

import pytest
import torch

from kvsieve.kernels import region_store

from helpers.region_store_case import assert_kernel_writes_what_the_reference_writes, region_case


@pytest.mark.parametrize("R, H, M, P, D, padded, quantized, dtype, own_columns", [
    (6, 4, 5, 16, 128, 0, 0, torch.float16, False),
    (5, 2, 23, 16, 64, 3, 0, torch.float16, False),
    (4, 4, 6, 8, 96, 2, 4, torch.float16, False),
    (200, 4, 20, 16, 128, 56, 0, torch.bfloat16, False),  # 256 rows at budget 256: a traffic step's shape
    (120, 4, 36, 16, 128, 8, 0, torch.bfloat16, True),  # a mixed step: rows narrower than its widest
])
def test_the_compiled_kernel_writes_what_the_pytorch_store_writes(R, H, M, P, D, padded, quantized, dtype,
                                                                 own_columns):
    case = region_case(R, H, M, P, D, seed=R, padded=padded, quantized_columns=quantized, region_dtype=dtype,
                       device="cuda", own_columns=own_columns)
    assert_kernel_writes_what_the_reference_writes(region_store, case)
