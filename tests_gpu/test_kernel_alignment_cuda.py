"""Per-row tensors reach the kernels as views into a step's shipped bytes
(policies.observations.rows_to_device, radix_ext/byte_pack.py), so their
16-byte alignment follows the row count. A kernel that specialized on it
compiled another variant when a new row count came, in the middle of
serving (1.1 s for the decode observation kernel under traffic on an H200,
2026-11-29). Here the same kernels run on aligned views and then on views
8 bytes off: no kernel compiles a second variant."""

import torch

from kvsieve.kernels import decode_attention as da
from kvsieve.kernels import region_store
from kvsieve.policies import Need

from helpers.region_store_case import region_case, run_store


def variants(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def off_by_8(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view whose data pointer is 8 bytes past a 16-byte boundary."""
    flat = torch.zeros(t.numel() * 2 + 16, dtype=t.dtype, device=t.device)
    step = 8 // t.element_size()
    view = flat[step:step + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 == 8
    return view


def test_the_store_compiles_once_whatever_the_rows_views_alignment():
    case = region_case(6, 4, 5, 16, 128, seed=0, device="cuda")
    run_store(region_store.store_new_tokens, case)
    compiled = variants(region_store._store_kernel)
    for name in ("batch_index", "positions", "pool_rows"):
        case[name] = off_by_8(case[name])
    run_store(region_store.store_new_tokens, case)
    assert variants(region_store._store_kernel) == compiled


def test_decode_attention_compiles_once_whatever_the_rows_views_alignment():
    g = torch.Generator(device="cuda").manual_seed(0)
    R, Hq, Hkv, D, P, M, PAGE = 6, 28, 4, 128, 40, 5, 16
    pages = R * Hkv * M
    args = dict(
        q=torch.randn(R, Hq, D, device="cuda", generator=g, dtype=torch.bfloat16),
        pool_k=torch.randn(4 * R * P, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16),
        pool_v=torch.randn(4 * R * P, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16),
        prefix_slots=torch.randint(0, 4 * R * P, (R, P), device="cuda", generator=g),
        prefix_len=torch.full((R,), P, dtype=torch.int64, device="cuda"),
        region_k=torch.randn(pages + 1, PAGE, D, device="cuda", generator=g, dtype=torch.bfloat16),
        region_v=torch.randn(pages + 1, PAGE, D, device="cuda", generator=g, dtype=torch.bfloat16),
        region_valid=torch.rand(pages + 1, PAGE, device="cuda", generator=g) < 0.7,
        table=torch.randperm(pages, device="cuda", generator=g).view(R, Hkv, M),
        scale=D ** -0.5, needs=Need.ATTENTION | Need.SPARSITY,
        row_columns=torch.full((R,), M, dtype=torch.int32, device="cuda"),
        row_observe=torch.full((R,), 0b1111, dtype=torch.int32, device="cuda"))
    args["region_valid"][pages] = False
    out, obs = da.decode_attention(**args)
    kernels = (da._partial_kernel, da._merge_kernel, da._observe_kernel)
    compiled = [variants(k) for k in kernels]
    assert all(compiled) and obs.attention is not None
    for name in ("prefix_len", "row_columns", "row_observe"):
        args[name] = off_by_8(args[name])
    out2, obs2 = da.decode_attention(**args)
    assert [variants(k) for k in kernels] == compiled
    assert torch.equal(out, out2) and torch.equal(obs.attention, obs2.attention)
