"""LongFlow's fused decode pass (kernels/longflow_fused.py) against the
PyTorch reference (kernels.attention_ref.attend_rows and LongFlow's decision
as PyTorch ops), on CPU through Triton's interpreter.

Run by tests/test_triton_kernels.py in a process of its own with
TRITON_INTERPRET=1 (it must be set before triton.language is first imported)."""

import os

import pytest
import torch

from kvsieve.kernels import attention_ref
from kvsieve.policies import Need

OBSERVED = Need.ATTENTION | Need.PV_NORM


@pytest.fixture(scope="module")
def lf():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"
    from kvsieve.kernels import longflow_fused

    return longflow_fused


def layer_case(R, Hq, Hkv, D, P, M, page, seed, lengths=None, density=0.7, null_columns=(), dtype=torch.float32):
    """A random layer: pool, region, page tables and token positions, with
    slots lined up across kv heads as LongFlow keeps them (the same valid
    slots in every head; positions distinct per row). `null_columns`:
    (row, column) pairs whose page is the null page in every head."""
    g = torch.Generator().manual_seed(seed)
    S = M * page
    pool_slots = 4 * R * max(P, 1) + 8
    pages = R * Hkv * M
    null_page = pages
    table = torch.randperm(pages, generator=g).view(R, Hkv, M)
    for r, c in null_columns:
        table[r, :, c] = null_page
    slot_valid = torch.rand(R, S, generator=g) < density  # per row, the same in every head
    positions = torch.stack([torch.randperm(4 * S, generator=g)[:S] for _ in range(R)])
    valid = torch.zeros(pages + 1, page, dtype=torch.bool)
    position = torch.full((pages + 1, page), -1, dtype=torch.int64)
    for h in range(Hkv):
        valid[table[:, h]] = slot_valid.view(R, M, page)
        position[table[:, h]] = torch.where(slot_valid, positions, -1).view(R, M, page)
    valid[null_page] = False
    position[null_page] = -1
    case = dict(
        q=torch.randn(R, Hq, D, generator=g).to(dtype) * 2,
        pool_k=torch.randn(pool_slots, Hkv, D, generator=g).to(dtype),
        pool_v=torch.randn(pool_slots, Hkv, D, generator=g).to(dtype),
        prefix_slots=torch.randint(0, pool_slots, (R, P), generator=g),
        prefix_len=torch.tensor(lengths if lengths is not None else [P] * R),
        region_k=torch.randn(pages + 1, page, D, generator=g).to(dtype),
        region_v=torch.randn(pages + 1, page, D, generator=g).to(dtype),
        region_valid=valid, table=table)
    return case, position


def reference(case, scale, position, protect=None):
    """attend_rows' output and observations, LongFlow's layer score [R, S]
    and its victim (argmin over valid slots of kv head 0 but, where protect,
    the newest; -1 without a candidate), as the policy computes them."""
    R, P = case["prefix_slots"].shape
    table, page = case["table"], case["region_k"].shape[1]
    Hkv, M = table.shape[1:]
    S = M * page
    prefix_mask = torch.arange(P).unsqueeze(0) < case["prefix_len"].unsqueeze(1)
    rk = case["region_k"][table].reshape(R, Hkv, S, -1)
    rv = case["region_v"][table].reshape(R, Hkv, S, -1)
    view_valid = case["region_valid"][table].reshape(R, Hkv, S)
    out, obs = attention_ref.attend_rows(case["q"].unsqueeze(1), case["pool_k"][case["prefix_slots"]],
                                         case["pool_v"][case["prefix_slots"]], prefix_mask, rk, rv,
                                         view_valid.unsqueeze(1), scale, OBSERVED)
    score = obs.pv_norm.sum(dim=1)
    valid0 = view_valid[:, 0]
    pos0 = position[table[:, 0]].reshape(R, S)
    protect = torch.ones(R, dtype=torch.bool) if protect is None else protect.bool()
    newest = torch.where(valid0, pos0, -1).amax(-1, keepdim=True)
    cand = valid0 & ~(protect.unsqueeze(1) & (pos0 == newest))
    victim = torch.where(cand, score, torch.inf).argmin(-1)
    victim = torch.where(cand.any(-1), victim, -1)
    return out[:, 0], obs, score, cand, victim


def assert_victims(victim, ref_victim, score, cand, rel=1e-5):
    """The same slot as the reference, or (a near tie in float rounding) a
    candidate whose reference score is within `rel` of the minimum."""
    for r in range(victim.shape[0]):
        v, w = int(victim[r]), int(ref_victim[r])
        if v == w:
            continue
        assert v >= 0 and w >= 0 and bool(cand[r, v]), (r, v, w)
        assert float(score[r, v]) <= float(score[r, w]) * (1 + rel), (r, v, w, float(score[r, v]),
                                                                     float(score[r, w]))


CASES = [
    # R, Hq, Hkv, D, P, M, page, lengths, null columns, block
    (3, 4, 2, 32, 20, 3, 16, [20, 7, 0], [], 16),  # ragged prefixes, one row without
    (2, 7, 1, 64, 0, 4, 8, None, [(1, 2)], 16),  # G = 7 (folded from 16 rows to 8), a null column
    (2, 8, 4, 16, 33, 2, 16, [33, 1], [(0, 1)], 16),  # 4 kv heads summed
    (2, 8, 2, 16, 0, 9, 16, None, [(0, 8), (1, 0)], 16),  # 9 blocks: a tile of 8 blocks and one of 1
    (1, 4, 1, 16, 5, 5, 8, None, [], 32),  # block larger than a page, a tail block
]


@pytest.mark.parametrize("R,Hq,Hkv,D,P,M,page,lengths,nulls,block", CASES)
@pytest.mark.parametrize("tile_fp16", [False, True])
def test_observations_and_output_match_the_reference(lf, R, Hq, Hkv, D, P, M, page, lengths, nulls, block,
                                                     tile_fp16):
    case, position = layer_case(R, Hq, Hkv, D, P, M, page, seed=R * 100 + M, lengths=lengths, null_columns=nulls)
    scale = D ** -0.5
    out, obs = lf.decode_attention_observed(**case, scale=scale, needs=OBSERVED, block=block, tile_fp16=tile_fp16)
    ref_out, ref, _, _, _ = reference(case, scale, position)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    # fp32 logits kept on chip: as exact as the reference; fp16 like the split path's scratch.
    tol = dict(atol=1e-4, rtol=2e-3) if tile_fp16 else dict(atol=1e-6, rtol=2e-5)
    torch.testing.assert_close(obs.attention, ref.attention, **tol)
    torch.testing.assert_close(obs.pv_norm, ref.pv_norm, **tol)


@pytest.mark.parametrize("R,Hq,Hkv,D,P,M,page,lengths,nulls,block", CASES)
def test_one_kernel_and_the_merge_pick_the_reference_victim(lf, R, Hq, Hkv, D, P, M, page, lengths, nulls, block):
    case, position = layer_case(R, Hq, Hkv, D, P, M, page, seed=R * 100 + M + 1, lengths=lengths,
                                null_columns=nulls)
    scale = D ** -0.5
    protect = torch.tensor([r % 2 == 0 for r in range(R)], dtype=torch.int32)  # rows with and without
    ref_out, ref, score, cand, ref_victim = reference(case, scale, position, protect)
    out, victim, best, obs = lf.longflow_decode(**case, scale=scale, region_position=position, protect=protect,
                                                needs=Need.PV_NORM, block=block)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(obs.pv_norm, ref.pv_norm, atol=1e-6, rtol=2e-5)
    assert obs.attention is None
    assert victim.dtype == torch.int64
    assert_victims(victim, ref_victim, score, cand)
    torch.testing.assert_close(best, score.gather(1, victim.clamp(min=0).unsqueeze(1)).squeeze(1), rtol=2e-5,
                               atol=0)
    # The merge of the per-head form over the reference's own pv_norm: the reference's argmin exactly.
    table = case["table"]
    S = table.shape[2] * case["region_k"].shape[1]
    valid0 = case["region_valid"][table[:, 0]].reshape(R, S)
    pos0 = position[table[:, 0]].reshape(R, S)
    merged, merged_best = lf.longflow_select(ref.pv_norm, valid0, pos0, protect)
    assert merged.tolist() == ref_victim.tolist()


def test_ties_go_to_the_lowest_slot_in_every_form(lf):
    """Slots whose keys are zero and values equal in every head score the
    same to the last bit; made the lowest, the victim is the first of them
    (torch.argmin's rule), in the one-kernel form, the merge and PyTorch."""
    R, Hq, Hkv, D, M, page = 2, 8, 2, 16, 4, 8
    case, position = layer_case(R, Hq, Hkv, D, 0, M, page, seed=11, density=1.0)
    table = case["table"]
    tied = [(0, (5, 9, 30)), (1, (17, 18))]  # (row, slots)
    for r, slots in tied:
        for s in slots:
            for h in range(Hkv):
                pg, off = table[r, h, s // page], s % page
                case["region_k"][pg, off] = 0.0
                case["region_v"][pg, off] = 1e-4  # far below every other slot's |v|
    scale = D ** -0.5
    protect = torch.ones(R, dtype=torch.int32)
    _, ref, score, cand, ref_victim = reference(case, scale, position, protect)
    assert ref_victim.tolist() == [5, 17]
    _, victim, _, obs = lf.longflow_decode(**case, scale=scale, region_position=position, protect=protect,
                                           needs=Need.PV_NORM, block=16)
    assert victim.tolist() == [5, 17]
    for r, slots in tied:  # the tie is exact in the kernel too
        assert len({float(obs.pv_norm[r].sum(0)[s]) for s in slots}) == 1
    valid0 = case["region_valid"][table[:, 0]].reshape(R, -1)
    pos0 = position[table[:, 0]].reshape(R, -1)
    assert lf.longflow_select(obs.pv_norm, valid0, pos0, protect)[0].tolist() == [5, 17]


def test_the_newest_is_protected_and_rows_without_candidates_get_none(lf):
    R, Hq, Hkv, D, M, page = 3, 4, 2, 16, 2, 8
    case, position = layer_case(R, Hq, Hkv, D, 0, M, page, seed=13, density=0.0)
    table = case["table"]
    # Row 0: one valid slot (the newest): no candidate with protect. Row 1: the
    # newest is the lowest score (tiny values), so protecting it matters. Row 2:
    # nothing valid, no prefix (a padded row): output 0, no candidate.
    for r, slots in ((0, (3,)), (1, (1, 4, 6, 12))):
        for h in range(Hkv):
            for s in slots:
                case["region_valid"][table[r, h, s // page], s % page] = True
                position[table[r, h, s // page], s % page] = 10_000 if (r, s) == (1, 6) else s  # row 1: 6 newest
    for h in range(Hkv):
        case["region_v"][table[1, h, 6 // page], 6 % page] = 1e-6
    scale = D ** -0.5
    protect = torch.ones(R, dtype=torch.int32)
    ref_out, _, score, cand, ref_victim = reference(case, scale, position, protect)
    out, victim, best, _ = lf.longflow_decode(**case, scale=scale, region_position=position, protect=protect,
                                              block=16)
    assert victim[0] == -1 and victim[2] == -1 and best[0] == float("inf")
    assert victim[1] == ref_victim[1] and victim[1] != 6
    assert torch.all(out[2] == 0)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    # Without protection slot 6 (the lowest) is the victim, and row 0's only slot is a candidate.
    _, victim, _, _ = lf.longflow_decode(**case, scale=scale, region_position=position,
                                         protect=torch.zeros(R, dtype=torch.int32), block=16)
    assert victim.tolist() == [3, 6, -1]


def test_decode_attention_routes_longflow_steps_to_the_fused_pass(lf):
    from kvsieve.kernels import decode_attention as da

    case, position = layer_case(2, 8, 2, 16, 9, 3, 8, seed=17, lengths=[9, 4])
    scale = 0.25
    calls = []
    original = lf.decode_attention_observed
    lf.decode_attention_observed = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        out, obs = da.decode_attention(**case, scale=scale, needs=OBSERVED)
        assert calls == [1]
        out_split, obs_split = da.decode_attention(**case, scale=scale, needs=OBSERVED, fused=False)
        da.decode_attention(**case, scale=scale, needs=OBSERVED, num_splits=2)  # splits asked: the split path
        da.decode_attention(**case, scale=scale, needs=OBSERVED | Need.SPARSITY)  # sparsity: the split path
        da.decode_attention(**case, scale=scale, needs=Need.ATTENTION)  # no LongFlow rows: the split path
        assert calls == [1]
        os.environ[lf.ENV] = "0"
        da.decode_attention(**case, scale=scale, needs=OBSERVED)
        assert calls == [1]
    finally:
        os.environ.pop(lf.ENV, None)
        lf.decode_attention_observed = original
    torch.testing.assert_close(out, out_split, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(obs.attention, obs_split.attention, atol=1e-4, rtol=2e-3)
    torch.testing.assert_close(obs.pv_norm, obs_split.pv_norm, atol=1e-4, rtol=2e-3)


def test_longflow_policy_decides_the_same_through_the_merge_kernel(lf):
    """LongFlowPolicy.select_decode step by step on random pv_norm: the merge
    kernel's victims equal its PyTorch ops' (KVSIEVE_LONGFLOW_FUSED=0), with
    protect_recent 0 and 1; protect_recent 2 keeps the PyTorch ops."""
    from kvsieve.policies import Observations, PolicyBatch, SlotView, get_policy
    from kvsieve.policies import longflow

    H, S = 3, 40
    cls = get_policy("longflow")
    calls = []
    original = lf.longflow_select
    lf.longflow_select = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        for protects in ([0, 1, 0], [2, 0, 1]):
            rows = [cls.Params(protect_recent=p) for p in protects]
            tensors, maxima = cls.batch_params(rows)
            budgets = torch.tensor([6, 9, 12])
            batch = PolicyBatch(layer=0, budget=budgets.unsqueeze(1).expand(-1, H), step=torch.zeros(3),
                                params=tensors, maxima=maxima)
            policy = cls()
            gen = torch.Generator().manual_seed(sum(protects))
            view = SlotView(valid=torch.zeros(3, H, S, dtype=torch.bool),
                            position=torch.full((3, H, S), -1, dtype=torch.int64), score=None, last_hit=None)
            for step in range(30):
                slot = (~view.valid).int().argmax(dim=-1, keepdim=True)
                view.valid.scatter_(-1, slot, True)
                view.position.scatter_(-1, slot, step)
                pv = torch.rand(3, H, S, generator=gen) * view.valid
                pv[:, :, 2] = pv[:, :, 3]  # a tie every step
                obs = Observations(pv_norm=pv)
                before = len(calls)
                fused = policy.select_decode(batch, view, obs)
                assert len(calls) == before + (max(protects) <= 1)
                os.environ[lf.ENV] = "0"
                try:
                    plain = policy.select_decode(batch, view, obs)
                finally:
                    os.environ.pop(lf.ENV)
                assert torch.equal(fused, plain), step
                view.valid &= ~fused
                view.position[~view.valid] = -1
        assert longflow.fused_victim is not None
    finally:
        lf.longflow_select = original
