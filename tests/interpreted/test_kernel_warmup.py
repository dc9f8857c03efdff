"""radix_ext/kernel_warmup.py on CPU through Triton's interpreter: the
warm-up launches the decode attention once for every combination of the
observations a batch may read (and LongFlow's combinations through the
split-KV path too), on the region's own buffers and padded rows, and each
launch returns what the same call of a serving step returns for rows of
null pages: zeros. Whether it leaves nothing to compile mid-serving is
tests_gpu/test_kernel_warmup_cuda.py's (Triton compiles on a GPU only).

Run by tests/test_triton_kernels.py in a process of its own with
TRITON_INTERPRET=1."""

import os

import pytest
import torch

from kvsieve.policies import Need
from kvsieve.radix_ext.pages import PageManager, RegionConfig
from kvsieve.radix_ext.step_meta import observe_bits_of


@pytest.fixture(scope="module")
def warmup():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"
    from kvsieve.radix_ext import kernel_warmup

    return kernel_warmup


def test_every_observation_combination_is_launched_once_per_route(warmup, monkeypatch):
    pages = PageManager(RegionConfig(num_layers=2, num_kv_heads=2, head_dim=32, num_pages=64, page_size=16,
                                     dtype=torch.float32, device="cpu", max_rows=4))
    pool_k = torch.zeros(64, 2, 32)
    pool_v = torch.zeros(64, 2, 32)
    calls = []
    real = warmup.decode_attention

    def recorded(*args, **kw):
        out, obs = real(*args, **kw)
        calls.append((args[10], kw["fused"], kw["row_observe"][0].item()))
        assert torch.count_nonzero(out) == 0  # rows of null pages and an empty prefix
        for kind in ("attention", "pv_norm"):
            t = getattr(obs, kind)
            assert t is None or torch.count_nonzero(t) == 0
        return out, obs

    monkeypatch.setattr(warmup, "decode_attention", recorded)
    launches = warmup.warm_up_decode(pages, pool_k, pool_v, q_heads=4, dtype=torch.float32, rows=3)
    assert launches == len(calls)
    combos = {needs for needs, _, _ in calls}
    observed = Need.ATTENTION | Need.PV_NORM | Need.SPARSITY
    assert {n & observed for n in combos} == {n for n in warmup.need_sets()} and len(warmup.need_sets()) == 8
    # LongFlow's needs go through its fused pass by default; the split path is launched for them too.
    from kvsieve.kernels import longflow_fused
    for needs, fused, bits in calls:
        assert bits == observe_bits_of(needs)
        if fused is False:
            assert longflow_fused.applies(needs, None, 16)
    assert any(fused is False for _, fused, _ in calls) == longflow_fused.applies(Need.PV_NORM, None, 16)


def test_the_warmup_can_be_turned_off(warmup, monkeypatch):
    monkeypatch.setenv(warmup.ENV, "0")
    assert not warmup.enabled()
    monkeypatch.setenv(warmup.ENV, "yes")
    with pytest.raises(ValueError, match=warmup.ENV):
        warmup.enabled()


def test_longflow_select_is_launched_once_per_tile_on_an_empty_row(warmup, monkeypatch):
    from kvsieve.kernels import longflow_fused

    pages = PageManager(RegionConfig(num_layers=2, num_kv_heads=2, head_dim=32, num_pages=64, page_size=16,
                                     dtype=torch.float32, device="cpu", max_rows=4))
    calls = []
    real = longflow_fused.longflow_select

    def recorded(pv_norm, valid, position, protect=None):
        victim, best = real(pv_norm, valid, position, protect)
        calls.append((pv_norm.shape, pv_norm.dtype, valid.dtype, position.dtype, valid.stride(0)))
        assert victim.tolist() == [-1] and best.tolist() == [float("inf")]  # no valid slot: no candidate
        return victim, best

    monkeypatch.setattr(longflow_fused, "longflow_select", recorded)
    launches = warmup.warm_up_select(pages)
    assert launches == len(calls) == 10  # 16, 32, ..., 8,192 slots: every tile up to FUSED_MAX_SLOTS
    assert [shape[2] for shape, *_ in calls] == warmup.select_tiles(16) == [16 << i for i in range(10)]
    for shape, pv_dtype, valid_dtype, position_dtype, stride in calls:
        assert shape[:2] == (1, 2) and pv_dtype == torch.float32 and stride == 2 * shape[2]  # kv head 0 of [1, H, S]
        assert valid_dtype == pages.valid.dtype and position_dtype == pages.position.dtype
