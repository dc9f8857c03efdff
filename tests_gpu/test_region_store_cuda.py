"""The fused store of a decode step's new tokens (kernels/region_store.py)
compiled for the GPU, against its PyTorch form on the same device: the same
cases as tests/interpreted/test_region_store.py, at a 7B model's shapes too
(4 kv heads, head_dim 128, bf16 K/V into the region's dtype)."""

import pytest
import torch

from kvsieve.kernels import region_store

from helpers.region_store_case import region_case, run_store


@pytest.mark.parametrize("R, H, M, P, D, padded, quantized, dtype", [
    (6, 4, 5, 16, 128, 0, 0, torch.float16),
    (5, 2, 23, 16, 64, 3, 0, torch.float16),
    (4, 4, 6, 8, 96, 2, 4, torch.float16),
    (200, 4, 20, 16, 128, 56, 0, torch.bfloat16),  # 256 rows at budget 256: a traffic step's shape
])
def test_the_compiled_kernel_writes_what_the_pytorch_store_writes(R, H, M, P, D, padded, quantized, dtype):
    case = region_case(R, H, M, P, D, seed=R, padded=padded, quantized_columns=quantized, region_dtype=dtype,
                       device="cuda")
    want = run_store(region_store.store_new_tokens_reference, case)
    got = run_store(region_store.store_new_tokens, case)
    null = case["null_page"]
    for name in ("valid", "position", "score", "last_hit", "overflow_flags"):
        assert torch.equal(got[name], want[name]), name
    for name in ("region_k", "region_v"):
        assert torch.equal(got[name][:null], want[name][:null]), name
    torch.testing.assert_close(got["vnorm"][:null], want["vnorm"][:null], rtol=1e-6, atol=0)
    assert not torch.equal(want["valid"], case["valid"])
