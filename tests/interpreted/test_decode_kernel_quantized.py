"""The Triton decode kernel over quantized pages (TBQ) against the PyTorch
reference on the same pages dequantized by kernels.kv_formats: full-precision
and quantized pages of every format mixed in one row's page table, with every
observation. Run by tests/test_triton_kernels.py (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

from kvsieve.kernels import attention_ref
from kvsieve.kernels import kv_formats as kvf
from kvsieve.policies import Need
from kvsieve.radix_ext.pages import PageManager, RegionConfig

ALL = Need.ATTENTION | Need.PV_NORM | Need.SPARSITY


@pytest.fixture(scope="module")
def kernel():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"
    from kvsieve.kernels import decode_attention

    return decode_attention


def region_with_every_format(R, Hkv, D, M, bits, seed):
    """A page manager whose rows own full pages (column 0) and quantized
    pages of every format the class holds, partly valid."""
    g = torch.Generator().manual_seed(seed)
    config = RegionConfig(num_layers=1, num_kv_heads=Hkv, head_dim=D, num_pages=R * Hkv + 2,
                          quant_pages=R * Hkv * (M - 1) + 2, quant_bits=bits, max_rows=R)
    pm = PageManager(config)
    for r in range(R):
        pm.allocate(f"r{r}", 1, M - 1)
        pm.bind(f"r{r}", r)
    pm.flush()
    table = pm.table[:, 0].clone()  # [R, H, M]
    formats = [kvf.TERNARY, kvf.NVFP4] + ([kvf.FP8] if bits == 8 else [])
    S = config.page_size
    full = table[:, :, 0].reshape(-1)
    pm.k[full] = torch.randn(full.numel(), S, D, generator=g)
    pm.v[full] = torch.randn(full.numel(), S, D, generator=g)
    pm.valid[full] = torch.rand(full.numel(), S, generator=g) < 0.6
    quant = table[:, :, 1:].reshape(-1)
    fmt = torch.tensor([formats[i % len(formats)] for i in range(quant.numel())])
    k = torch.randn(quant.numel(), S, D, generator=g) * 2
    v = torch.randn(quant.numel(), S, D, generator=g) * 0.1
    valid = torch.rand(quant.numel(), S, generator=g) < 0.8
    pm.quant.write(pm.quant.rows_of(quant), kvf.quantize_pages(k, v, valid, fmt, bits))
    pm.format[quant] = fmt.to(torch.int8)
    pm.valid[quant] = valid
    deq_v = pm.quant.dequantize(pm, quant)[1]
    pm.vnorm[quant] = deq_v.abs().sum(-1)
    pm.vnorm[full] = pm.v[full].abs().sum(-1)
    return pm, table


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_reads_each_page_at_its_precision(kernel, bits):
    R, Hq, Hkv, D, M, P = 3, 4, 2, 32, 4, 5
    pm, table = region_with_every_format(R, Hkv, D, M, bits, seed=bits)
    g = torch.Generator().manual_seed(7)
    pool_k = torch.randn(64, Hkv, D, generator=g)
    pool_v = torch.randn(64, Hkv, D, generator=g)
    prefix_slots = torch.randint(0, 64, (R, P), generator=g)
    prefix_len = torch.tensor([P, 2, 0])
    q = torch.randn(R, Hq, D, generator=g)
    scale = D ** -0.5
    out, obs = kernel.decode_attention(q, pool_k, pool_v, prefix_slots, prefix_len, pm.k, pm.v, pm.valid, table,
                                       scale, ALL, region_vnorm=pm.vnorm, num_splits=2, block=16, quant=pm.quant,
                                       formats=pm.format)
    rk, rv = pm.kv_of(table)
    S = M * pm.config.page_size
    prefix_mask = torch.arange(P).unsqueeze(0) < prefix_len.unsqueeze(1)
    mask = pm.valid[table].reshape(R, 1, Hkv, S)
    ref_out, ref = attention_ref.attend_rows(q.unsqueeze(1), pool_k[prefix_slots], pool_v[prefix_slots],
                                             prefix_mask, rk.reshape(R, Hkv, S, D), rv.reshape(R, Hkv, S, D), mask,
                                             scale, ALL)
    torch.testing.assert_close(out, ref_out[:, 0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(obs.attention, ref.attention, atol=1e-4, rtol=2e-3)
    torch.testing.assert_close(obs.pv_norm, ref.pv_norm, atol=1e-4, rtol=2e-3)
    torch.testing.assert_close(obs.sparsity, ref.sparsity, atol=1e-6, rtol=0)
    # The quantized pages did take part: their slots hold attention mass.
    quantized = (table > pm.null_page).unsqueeze(-1).expand(R, Hkv, M, pm.config.page_size).reshape(R, Hkv, S)
    assert float(obs.attention[quantized].sum()) > 0.1
