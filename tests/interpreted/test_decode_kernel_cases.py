"""The Triton decode-attention kernel against the PyTorch reference
(kernels.attention_ref.attend_rows), on CPU through Triton's interpreter:
the same kernel source the GPU compiles. bench/kernel_check.py runs the same
comparison at real shapes on a GPU.

Run by tests/test_triton_kernels.py in a process of its own with
TRITON_INTERPRET=1 (it must be set before triton.language is first imported)."""

import contextlib
import os

import pytest
import torch

from kvsieve.kernels import attention_ref
from kvsieve.policies import Need

ALL = Need.ATTENTION | Need.PV_NORM | Need.SPARSITY


@pytest.fixture(scope="module")
def kernel():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"
    from kvsieve.kernels import decode_attention

    return decode_attention


def random_case(R, Hq, Hkv, D, P, M, page, dtype, seed, lengths=None, density=0.7):
    """Random pool, region and page tables; returns the kernel's inputs and
    the reference's (dense gathers of the same data)."""
    g = torch.Generator().manual_seed(seed)
    pool_slots = 4 * R * max(P, 1) + 8
    pool_k = torch.randn(pool_slots, Hkv, D, generator=g).to(dtype)
    pool_v = torch.randn(pool_slots, Hkv, D, generator=g).to(dtype)
    pages = R * Hkv * M + 3
    region_k = torch.randn(pages + 1, page, D, generator=g).to(dtype)  # + the null page
    region_v = torch.randn(pages + 1, page, D, generator=g).to(dtype)
    valid = torch.rand(pages + 1, page, generator=g) < density
    valid[-1] = False  # the null page
    table = torch.randperm(pages, generator=g)[:R * Hkv * M].view(R, Hkv, M)
    table[0, 0, -1] = pages  # one head with fewer pages: a null column
    prefix_len = torch.tensor(lengths if lengths is not None else [P] * R)
    prefix_slots = torch.randint(0, pool_slots, (R, P), generator=g)
    q = torch.randn(R, Hq, D, generator=g).to(dtype)
    return dict(q=q, pool_k=pool_k, pool_v=pool_v, prefix_slots=prefix_slots, prefix_len=prefix_len,
                region_k=region_k, region_v=region_v, region_valid=valid, table=table)


def reference(case, scale, needs):
    R, P = case["prefix_slots"].shape
    table, page = case["table"], case["region_k"].shape[1]
    Hkv, M = table.shape[1:]
    prefix_mask = torch.arange(P).unsqueeze(0) < case["prefix_len"].unsqueeze(1)
    pk = case["pool_k"][case["prefix_slots"]]
    pv = case["pool_v"][case["prefix_slots"]]
    rk = case["region_k"][table].reshape(R, Hkv, M * page, -1)
    rv = case["region_v"][table].reshape(R, Hkv, M * page, -1)
    mask = case["region_valid"][table].reshape(R, 1, Hkv, M * page)
    out, obs = attention_ref.attend_rows(case["q"].unsqueeze(1), pk, pv, prefix_mask, rk, rv, mask, scale, needs)
    return out[:, 0], obs


@contextlib.contextmanager
def poisoned_scratch():
    """torch.empty fills floating buffers with NaN meanwhile: a kernel that
    reads scratch it never wrote cannot match a reference by luck."""
    real_empty = torch.empty

    def poisoned_empty(*shape, dtype=None, **kw):
        t = real_empty(*shape, dtype=dtype, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned_empty
    try:
        yield
    finally:
        torch.empty = real_empty


CASES = [
    # R, Hq, Hkv, D, P, M, page, splits, lengths
    (3, 4, 2, 32, 20, 3, 16, None, [20, 7, 0]),  # ragged prefixes, one without
    (2, 7, 1, 64, 0, 4, 8, 3, None),  # no prefix, G = 7 (padded to 16), several splits
    (2, 8, 4, 16, 33, 2, 16, 2, [33, 1]),
    (1, 4, 1, 16, 40, 20, 8, 3, None),  # more key blocks than one observation program reads
]


@pytest.mark.parametrize("R,Hq,Hkv,D,P,M,page,splits,lengths", CASES)
def test_kernel_matches_the_reference_with_every_observation(kernel, R, Hq, Hkv, D, P, M, page, splits, lengths):
    case = random_case(R, Hq, Hkv, D, P, M, page, torch.float32, seed=R * 100 + P, lengths=lengths)
    scale = D ** -0.5
    out, obs = kernel.decode_attention(**case, scale=scale, needs=ALL, num_splits=splits, block=16)
    ref_out, ref = reference(case, scale, ALL)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    # Observations come from fp16 logits relative to their block's max.
    torch.testing.assert_close(obs.attention, ref.attention, atol=1e-4, rtol=2e-3)
    torch.testing.assert_close(obs.pv_norm, ref.pv_norm, atol=1e-3, rtol=2e-3)
    torch.testing.assert_close(obs.sparsity, ref.sparsity, atol=0.02, rtol=0)


def test_observations_are_only_computed_when_asked(kernel):
    case = random_case(2, 4, 2, 16, 5, 2, 8, torch.float32, seed=7)
    out, obs = kernel.decode_attention(**case, scale=0.25)
    assert obs.attention is None and obs.pv_norm is None and obs.sparsity is None
    out_attn, obs = kernel.decode_attention(**case, scale=0.25, needs=Need.ATTENTION)
    torch.testing.assert_close(out, out_attn)
    ref_out, ref = reference(case, 0.25, Need.ATTENTION)
    torch.testing.assert_close(obs.attention, ref.attention, atol=1e-4, rtol=2e-3)
    assert obs.pv_norm is None and obs.sparsity is None


def test_a_row_that_sees_nothing_gets_zeros(kernel):
    case = random_case(2, 4, 2, 16, 4, 2, 8, torch.float32, seed=3, lengths=[4, 0])
    case["region_valid"][case["table"][1].flatten()] = False  # row 1: no prefix, no valid slot
    out, obs = kernel.decode_attention(**case, scale=0.25, needs=Need.ATTENTION)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(obs.attention[1], torch.zeros_like(obs.attention[1]))
    assert torch.isfinite(out).all()


def test_half_precision_inputs_stay_within_half_precision_error(kernel):
    # fp16 here: the CPU interpreter mis-reads bf16 (NumPy has no bf16);
    # bench/kernel_check.py checks bf16 on the GPU.
    case = random_case(2, 8, 2, 32, 16, 2, 16, torch.float16, seed=11)
    out, obs = kernel.decode_attention(**case, scale=32 ** -0.5, needs=Need.ATTENTION, num_splits=2)
    ref_out, ref = reference(case, 32 ** -0.5, Need.ATTENTION)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(obs.attention, ref.attention, atol=2e-3, rtol=2e-2)


def test_a_kept_value_norm_replaces_reading_values(kernel):
    # The region may keep ||v||_1 per slot: PV_NORM then reads it, not V.
    case = random_case(2, 4, 2, 16, 6, 3, 8, torch.float32, seed=5)
    vnorm = case["region_v"].abs().sum(-1)
    _, obs = kernel.decode_attention(**case, scale=0.25, needs=Need.PV_NORM, region_vnorm=vnorm)
    _, ref = reference(case, 0.25, Need.ATTENTION | Need.PV_NORM)
    torch.testing.assert_close(obs.pv_norm, ref.pv_norm, atol=1e-3, rtol=2e-3)
    assert obs.attention is None


def test_default_splits_scale_with_the_keys(kernel):
    assert [kernel.default_splits(n) for n in (1, 512, 513, 4096, 1 << 20)] == [1, 1, 2, 8, 16]


@pytest.mark.parametrize("R,Hq,Hkv,D,P,M,page,splits,lengths", CASES)
def test_sparsity_alone_reads_logits_the_kernel_wrote(kernel, R, Hq, Hkv, D, P, M, page, splits, lengths):
    """ThinKV asks for SPARSITY without ATTENTION: the region's logits must
    still be stored for the observation pass (they were not, and it read
    whatever the buffer held). The buffer is poisoned first, so a pass that
    reads logits nobody wrote cannot match the reference by luck."""
    case = random_case(R, Hq, Hkv, D, P, M, page, torch.float32, seed=R * 100 + P + 1, lengths=lengths)
    scale = D ** -0.5
    with poisoned_scratch():
        _, obs = kernel.decode_attention(**case, scale=scale, needs=Need.SPARSITY, num_splits=splits, block=16)
    _, ref = reference(case, scale, Need.SPARSITY)
    assert obs.attention is None and obs.pv_norm is None
    torch.testing.assert_close(obs.sparsity, ref.sparsity, atol=0.02, rtol=0)


@pytest.mark.parametrize("splits", [None, 3])
def test_each_row_stops_at_its_own_columns(kernel, splits):
    """A step is padded to its widest row: with row_columns the kernel reads a
    row's pages only. Columns past a row's own hold real, valid pages here
    (never so in serving: null pages), so a kernel that read past them would
    differ from the reference over the row's own columns."""
    R, Hq, Hkv, D, P, M, page = 4, 4, 2, 32, 12, 6, 8
    columns = [6, 2, 0, 4]
    case = random_case(R, Hq, Hkv, D, P, M, page, torch.float32, seed=77, lengths=[12, 5, 0, 12], density=0.9)
    scale = D ** -0.5
    out, obs = kernel.decode_attention(**case, scale=scale, needs=ALL, num_splits=splits, block=16,
                                       row_columns=torch.tensor(columns, dtype=torch.int32))
    null = case["region_k"].shape[0] - 1
    own = dict(case, table=case["table"].clone())
    for r, c in enumerate(columns):
        own["table"][r, :, c:] = null
    ref_out, ref = reference(own, scale, ALL)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(obs.attention, ref.attention, atol=1e-4, rtol=2e-3)
    torch.testing.assert_close(obs.pv_norm, ref.pv_norm, atol=1e-4, rtol=2e-3)
    torch.testing.assert_close(obs.sparsity, ref.sparsity, atol=1e-6, rtol=0)
    assert obs.attention[1, :, 2 * page:].abs().sum() == 0 and obs.attention[2].abs().sum() == 0
    # Reading every column gives another answer for the rows cut short.
    whole, _ = kernel.decode_attention(**case, scale=scale, needs=ALL, num_splits=splits, block=16)
    assert not torch.allclose(whole[1], out[1], atol=1e-3)


@pytest.mark.parametrize("shift", [0, 3])
def test_each_row_observes_what_its_policy_reads(kernel, shift):
    """A mixed batch observes for the union of its policies' needs; with
    row_observe each row gets what its own policy reads: attention
    (OBSERVE_REGION) and |p*v| (OBSERVE_PV too: LongFlow's rows only) as the
    reference gives them, sparsity (OBSERVE_SPARSITY) as well, the rest 0
    (sparsity unspecified), and the outputs unchanged."""
    assert kernel.OBSERVE_BITS == 3
    R, Hq, Hkv, D, P, M, page = 6, 4, 2, 32, 12, 4, 8
    case = random_case(R, Hq, Hkv, D, P, M, page, torch.float32, seed=91, lengths=[12, 12, 3, 12, 0, 12],
                       density=0.9)
    scale = D ** -0.5
    # attention only (h2o), sparsity only (thinkv), attention + |p*v| + sparsity, nothing (a `full` row),
    # attention + |p*v| (LongFlow), attention
    bits = [0b001, 0b010, 0b111, 0b000, 0b101, 0b001]
    other_layers = 0b111 << (3 - shift)  # the other layers' bits: all set, never read at this shift
    row_observe = torch.tensor([(b << shift) | other_layers for b in bits], dtype=torch.int32)
    out, obs = kernel.decode_attention(**case, scale=scale, needs=ALL, block=16, row_observe=row_observe,
                                       observe_shift=shift)
    ref_out, ref = reference(case, scale, ALL)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    for r, b in enumerate(bits):
        if b & 1:
            torch.testing.assert_close(obs.attention[r], ref.attention[r], atol=1e-4, rtol=2e-3)
        else:
            assert obs.attention[r].abs().sum() == 0
        if b & 4:
            torch.testing.assert_close(obs.pv_norm[r], ref.pv_norm[r], atol=1e-4, rtol=2e-3)
        else:
            assert obs.pv_norm[r].abs().sum() == 0
        if b & 2:
            torch.testing.assert_close(obs.sparsity[r], ref.sparsity[r], atol=1e-6, rtol=0)


def test_a_narrow_rows_splits_past_its_columns_are_neither_written_nor_read(kernel):
    """Beside a wide row (a mixed batch's snapkv row) the step is padded to
    its width; a narrow row's splits past its own columns, and every region
    split of a row with no columns (a `full` row), hold none of its keys:
    the partial kernel writes nothing there and the merge does not read them
    (_dead_split). The scratch is poisoned (NaN), so reading an unwritten
    split shows; outputs and observations match the reference of each row's
    own columns and the row alone."""
    R, Hq, Hkv, D, page = 3, 4, 2, 32, 16
    case = random_case(R, Hq, Hkv, D, 40, 80, page, torch.float32, seed=17, lengths=[40, 40, 40], density=0.9)
    scale = D ** -0.5
    cols = torch.tensor([4, 80, 0], dtype=torch.int32)  # 64 slots (one split), 1,280 (three), none
    with poisoned_scratch():
        out, obs = kernel.decode_attention(**case, scale=scale, needs=ALL, row_columns=cols)
        alone = {key: (v[:1] if torch.is_tensor(v) and v.shape[:1] == (R,) else v) for key, v in case.items()}
        alone.update(table=case["table"][:1, :, :4])
        single, obs_a = kernel.decode_attention(**alone, scale=scale, needs=ALL, row_columns=cols[:1])
    assert torch.equal(single[0], out[0]) and torch.equal(obs_a.attention[0], obs.attention[0, :, :4 * page])
    null = case["region_k"].shape[0] - 1
    own = case["table"].clone()
    for r, c in enumerate(cols.tolist()):
        own[r, :, c:] = null  # the columns past a row's own hold null pages
    ref_out, ref = reference(dict(case, table=own), scale, ALL)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(obs.attention, ref.attention, atol=1e-4, rtol=2e-3)
    torch.testing.assert_close(obs.pv_norm, ref.pv_norm, atol=1e-4, rtol=2e-3)
    # fp16 logits: a key within rounding of the threshold may count either way
    torch.testing.assert_close(obs.sparsity, ref.sparsity, atol=0.02, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_rows_output_is_the_same_bits_beside_longer_rows(kernel, dtype):
    """Batch invariance (row_splits): a row alone and the same row beside a
    row of a long prefix and a wide region (a mixed batch's `full` or snapkv
    row) get the same output bits and observations; the old layout (splits
    from the batch's keys) did not (one fp16 unit here)."""
    R, Hq, Hkv, D, page = 2, 4, 2, 64, 16
    case = random_case(R, Hq, Hkv, D, 600, 48, page, dtype, seed=5, lengths=[64, 600], density=1.0)
    scale = D ** -0.5
    cols = torch.tensor([8, 48], dtype=torch.int32)
    batch, obs_b = kernel.decode_attention(**case, scale=scale, needs=ALL, row_columns=cols)
    alone = {key: (v[:1] if torch.is_tensor(v) and v.shape[:1] == (R,) else v) for key, v in case.items()}
    alone.update(prefix_slots=case["prefix_slots"][:1, :64], table=case["table"][:1, :, :8])
    single, obs_a = kernel.decode_attention(**alone, scale=scale, needs=ALL, row_columns=cols[:1])
    assert torch.equal(single[0], batch[0])
    assert torch.equal(obs_a.attention[0], obs_b.attention[0, :, :obs_a.attention.shape[-1]])
    assert torch.equal(obs_a.sparsity[0], obs_b.sparsity[0])
    # Splits from each batch's own keys (num_splits as default_splits gives
    # them: one alone, three beside the long row) sum the row otherwise.
    alone_splits, batch_splits = kernel.default_splits(64 + 8 * page), kernel.default_splits(608 + 48 * page)
    old_alone, _ = kernel.decode_attention(**alone, scale=scale, needs=ALL, row_columns=cols[:1],
                                           num_splits=alone_splits)
    old_batch, _ = kernel.decode_attention(**case, scale=scale, needs=ALL, row_columns=cols, num_splits=batch_splits)
    assert (alone_splits, batch_splits) == (1, 3) and not torch.equal(old_alone[0], old_batch[0])


@pytest.mark.parametrize("row_observe", [None, [0b111, 0b001, 0b010]])
def test_splits_between_a_rows_prefix_and_the_region_are_neither_written_nor_read(kernel, row_observe):
    """Beside a row of a long prefix (a `full` row of 1,700 tokens: four
    splits of 512), a short row's splits past its own prefix hold none of
    its keys: the partial kernel writes nothing there and the merge does not
    read them (_dead_split), nor does the observation pass read those blocks.
    The scratch is poisoned first (NaN), so reading an unwritten split or
    block shows; the outputs still match the reference and the row alone."""
    R, Hq, Hkv, D, page = 3, 4, 2, 32, 16
    case = random_case(R, Hq, Hkv, D, 1700, 3, page, torch.float32, seed=13, lengths=[40, 1700, 0], density=0.9)
    scale = D ** -0.5
    observe = None if row_observe is None else torch.tensor(row_observe, dtype=torch.int32)
    with poisoned_scratch():
        out, obs = kernel.decode_attention(**case, scale=scale, needs=ALL, row_observe=observe)
        alone = {key: (v[:1] if torch.is_tensor(v) and v.shape[:1] == (R,) else v) for key, v in case.items()}
        alone.update(prefix_slots=case["prefix_slots"][:1, :40])
        single, obs_a = kernel.decode_attention(**alone, scale=scale, needs=ALL,
                                                row_observe=None if observe is None else observe[:1])
    ref_out, ref = reference(case, scale, ALL)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    assert torch.equal(single[0], out[0])  # the same bits alone and beside the long row
    bits = row_observe or [0b111] * R
    for r, b in enumerate(bits):
        if b & 1:
            torch.testing.assert_close(obs.attention[r], ref.attention[r], atol=1e-4, rtol=2e-3)
        if b & 4:
            torch.testing.assert_close(obs.pv_norm[r], ref.pv_norm[r], atol=1e-4, rtol=2e-3)
        if b & 2:
            torch.testing.assert_close(obs.sparsity[r], ref.sparsity[r], atol=1e-6, rtol=0)
    assert torch.equal(obs_a.attention[0], obs.attention[0]) and torch.equal(obs_a.sparsity[0], obs.sparsity[0])
