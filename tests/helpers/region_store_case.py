"""A layer's region and a decode step's new tokens, random, for the store of
kernels/region_store.py (tests/interpreted/test_region_store.py on CPU,
tests_gpu/test_region_store_cuda.py on a GPU)."""

import torch


def region_case(R, H, M, P, D, seed, padded=0, quantized_columns=0, region_dtype=torch.float16, device="cpu",
                own_columns=False):
    """A layer's region with R real rows (+ `padded` rows of only the null
    page), each (row, head) owning M distinct pages, most slots taken. Row
    0's heads are all full (overflow), row 1's head 0 only is full; with
    quantized_columns, every real row's last columns are quantized ids.
    With own_columns, `row_columns` says each row holds fewer columns (rows
    past 2: 1 to M-1, so real pages with free slots lie past them; the
    padded rows 0), as a mixed batch's narrower rows do."""
    g = torch.Generator().manual_seed(seed)
    pages = R * H * M
    null_page = pages
    quant_ids = R * H * M
    ids = null_page + 1 + quant_ids  # valid & co span quantized ids too
    table = torch.randperm(pages, generator=g).view(R, H, M)
    if quantized_columns:
        q = null_page + 1 + torch.randperm(quant_ids, generator=g)[:R * H * quantized_columns]
        table[:, :, M - quantized_columns:] = q.view(R, H, quantized_columns)
    valid = torch.rand(ids, P, generator=g) < 0.8
    valid[null_page] = False
    valid[table[0]] = True  # row 0: no free slot in any head
    valid[table[1, 0]] = True  # row 1: head 0 full, the others not
    table = torch.cat([table, torch.full((padded, H, M), null_page)])
    rows = R + padded
    B = rows + 3  # the step's batch: compressed rows among others
    batch_index = torch.cat([torch.randperm(B, generator=g)[:R], torch.zeros(padded, dtype=torch.int64)])
    qkv = torch.randn(B, 3 * H, D, generator=g)
    case = dict(
        table=table, batch_index=batch_index,
        positions=torch.cat([torch.randint(0, 10_000, (R,), generator=g), torch.zeros(padded, dtype=torch.int64)]),
        pool_rows=torch.cat([torch.randperm(2 * R, generator=g)[:R], torch.full((padded,), 2 * R)]),
        k=qkv[:, H:2 * H], v=qkv[:, 2 * H:],  # strided views, as SGLang's fused qkv gives them
        region_k=torch.randn(pages + 1, P, D, generator=g).to(region_dtype),
        region_v=torch.randn(pages + 1, P, D, generator=g).to(region_dtype),
        valid=valid, vnorm=torch.rand(ids, P, generator=g),
        position=torch.randint(0, 10_000, (ids, P), generator=g),
        score=torch.rand(ids, P, generator=g), last_hit=torch.randint(0, 50, (ids, P), generator=g, dtype=torch.int32),
        overflow_flags=torch.zeros(2 * R + 1, dtype=torch.bool), null_page=null_page)
    if own_columns:
        narrower = torch.randint(1, M, (R,), generator=g)
        narrower[:3] = M  # rows 0-2 keep the overflow cases above
        case["row_columns"] = torch.cat([narrower, torch.zeros(padded, dtype=torch.int64)]).to(torch.int32)
    case = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    qkv = qkv.to(device)
    case["k"], case["v"] = qkv[:, H:2 * H], qkv[:, 2 * H:]  # strided on the device too
    return case


def run_store(fn, case):
    """`fn` on a copy of the case: the copy after the writes."""
    mine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    fn(**mine)
    return mine


def assert_kernel_writes_what_the_reference_writes(store_module, case) -> None:
    """The fused store and its PyTorch form on copies of `case`: the same
    bits (|v|_1 to fp32 rounding); and the case is what it says (the writes
    moved something; rows 0 and 1 overflowed, row 2 did not)."""
    want = run_store(store_module.store_new_tokens_reference, case)
    got = run_store(store_module.store_new_tokens, case)
    null = case["null_page"]
    for name in ("valid", "position", "score", "last_hit", "overflow_flags"):
        assert torch.equal(got[name], want[name]), name
    # Padded rows all write the null page's slot 0 (never valid): which row's
    # K/V lands there last is a race in both forms, so the null page is left out.
    for name in ("region_k", "region_v"):
        assert torch.equal(got[name][:null], want[name][:null]), name
    # |v|_1 in fp32, summed in another order: within a few units of the last place.
    torch.testing.assert_close(got["vnorm"][:null], want["vnorm"][:null], rtol=1e-6, atol=0)
    assert not torch.equal(want["valid"], case["valid"])
    flags, pool_rows = want["overflow_flags"], case["pool_rows"]
    # A head with no free slot is enough to overflow (row 1: head 0 only).
    assert flags[pool_rows[0]] and flags[pool_rows[1]] and not flags[pool_rows[2]]
