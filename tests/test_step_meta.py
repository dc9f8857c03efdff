"""The per-step metadata of the batched compressed path (host side), on the
real page manager and runtime. The ForwardBatch is a plain namespace with the
fields the step builder reads: it is what this test is not about."""

from types import SimpleNamespace

import pytest
import torch

from kvsieve.policies import Need, Policy, get_policy, policy_names, register_policy, registry
from kvsieve.radix_ext.pages import PageManager, RegionConfig
from kvsieve.radix_ext.runtime import RUNTIME
from kvsieve.radix_ext import step_meta
from kvsieve.radix_ext.step_meta import StepBuilder

L, H, D, P = 2, 2, 4, 4


class Mode:
    def __init__(self, decode):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode

    def is_idle(self):
        return False


@pytest.fixture
def runtime():
    RUNTIME.region = PageManager(RegionConfig(num_layers=L, num_kv_heads=H, head_dim=D, num_pages=2000,
                                              page_size=P, max_rows=8))
    RUNTIME.counters = torch.zeros((8, 2), dtype=torch.int64)
    RUNTIME.overflow_flags = torch.zeros(8, dtype=torch.bool)
    req_to_token = torch.arange(8 * 2000, dtype=torch.int32).view(8, 2000)
    try:
        yield StepBuilder(RUNTIME.region, req_to_token, "cpu")
    finally:
        RUNTIME.requests.clear()
        RUNTIME.token_observers.clear()
        RUNTIME.region = None


def admit(rid, policy, prompt_len, row, new_tokens=8):
    sgl_req = SimpleNamespace(req_pool_idx=row, to_finish=None)
    RUNTIME.admit(rid, {"kv_policy": policy}, prompt_len=prompt_len, sgl_req=sgl_req)
    req = RUNTIME.requests[rid]
    RUNTIME.reserve(req, prompt_len, new_tokens)
    return req


def decode_batch(rids, rows, seq_lens):
    return SimpleNamespace(
        rids=rids, forward_mode=Mode(decode=True), seq_lens_cpu=torch.tensor(seq_lens),
        seq_lens=torch.tensor(seq_lens), req_pool_indices=torch.tensor(rows),
        positions=torch.tensor(seq_lens) - 1, out_cache_loc=torch.zeros(len(rids), dtype=torch.int64))


def test_decode_rows_split_into_region_and_pool_with_one_group_per_policy(runtime):
    a = admit("a", {"name": "h2o", "budget": 8}, prompt_len=5, row=3)
    b = admit("b", {"name": "streaming", "budget": 6, "params": {"sinks": 2, "buffer": 1}}, prompt_len=7, row=5)
    a.prefix_len, b.prefix_len = 5, 7  # prompts kept in the radix cache
    meta = runtime.build(decode_batch(["a", "full-1", "b"], [3, 1, 5], [6, 9, 8]))
    rows = meta.region
    assert rows.batch_index.tolist() == [0, 2] and rows.pool_rows.tolist() == [3, 5]
    assert meta.pool_batch_index.tolist() == [1] and meta.pool_batch.batch_size == 1
    assert rows.prefix_mask.sum(1).tolist() == [5, 7]
    assert torch.equal(rows.prefix_slots[1, :7], torch.arange(5 * 2000, 5 * 2000 + 7))
    assert rows.positions.tolist() == [5, 7]
    # Page-table rows were bound and flushed before the forward reads them.
    assert (rows.tables != RUNTIME.region.null_page).all()
    # Each row's own columns (the kernel stops there, not at the step's width).
    assert rows.columns.tolist() == [RUNTIME.region.columns_of("a"), RUNTIME.region.columns_of("b")]
    assert rows.columns.dtype == torch.int32 and RUNTIME.region.columns_of_each(["a", "gone"])[1] == 0
    by_policy = {g.policy.name: g for g in rows.groups}
    assert by_policy["streaming"].params["sinks"].tolist() == [2]
    assert by_policy["h2o"].budget.tolist() == [8] and by_policy["streaming"].budget.tolist() == [6]
    assert [g.step.tolist() for g in rows.groups] == [[0], [0]]  # first generated token of each


def test_a_decode_row_with_an_unknown_prefix_fails_that_request_only(runtime):
    admit("a", {"name": "h2o", "budget": 8}, prompt_len=5, row=3)  # never prefilled here
    good = admit("b", {"name": "h2o", "budget": 8}, prompt_len=5, row=4)
    good.prefix_len = 5
    meta = runtime.build(decode_batch(["a", "b"], [3, 4], [6, 6]))
    assert meta.zero_batch_index.tolist() == [0]
    assert meta.region.batch_index.tolist() == [1]
    failed = RUNTIME.requests["a"]
    assert failed.overflowed and failed.sgl_req.to_finish is not None
    assert "unknown shared prefix" in failed.sgl_req.to_finish.message


def test_budget_ratio_counts_the_whole_prompt_in_every_layer(runtime):
    # One chunk of a 1,000-token private prompt at ratio 0.5: every layer's
    # selection gets 500, not the budget of the tokens seen before the chunk.
    admit("a", {"name": "snapkv", "budget_ratio": 0.5}, prompt_len=1000, row=2)
    fb = SimpleNamespace(
        rids=["a"], forward_mode=Mode(decode=False), extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[1000],
        req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([1000]), seq_lens_cpu=torch.tensor([1000]),
        positions=torch.arange(1000), out_cache_loc=torch.zeros(1000, dtype=torch.int64))
    meta = runtime.build(fb)
    ext = meta.extend
    assert ext.ending.tolist() == [0]
    assert [g.budget.tolist() for g in ext.ending_groups] == [[500]]
    assert ext.token_slot.tolist() == list(range(1000))
    assert ext.observe.sum().item() == 32  # snapkv's window of the prompt's last queries


def test_h2o_observes_every_query_of_its_private_prompt(runtime):
    # H2O accumulates attention from every prompt query:
    # 100 private prompt tokens, all 100 queries observed, not the last 32.
    admit("a", {"name": "h2o", "budget": 16, "compress_prompt": True}, prompt_len=100, row=2)
    fb = SimpleNamespace(
        rids=["a"], forward_mode=Mode(decode=False), extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[100],
        req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([100]), seq_lens_cpu=torch.tensor([100]),
        positions=torch.arange(100), out_cache_loc=torch.zeros(100, dtype=torch.int64))
    assert runtime.build(fb).extend.observe.sum().item() == 100


class _PerHeadBudgets(Policy):
    """A test policy whose step_inputs give each (layer, head) its own
    budget and echo the rows' steps and pool rows (registered only here)."""

    name = "test_per_head_budgets"

    def step_inputs(self, rows, device):
        budgets = [[[row.budget + 10 * layer + head for head in range(H)] for layer in range(L)] for row in rows]
        return {"budget": torch.tensor(budgets, device=device),
                "echo": torch.tensor([[row.step, row.pool_row, int(row.prefill)] for row in rows], device=device)}

    def select_decode(self, batch, view, obs):
        return None  # a decision (which would read the budgets): the policy forms a decode group


@pytest.fixture
def per_head_policy():
    register_policy(_PerHeadBudgets)
    yield
    registry._POLICIES.pop(_PerHeadBudgets.name)  # later tests list the registered policies


def test_step_inputs_reach_the_decisions_with_per_layer_head_budgets(runtime, per_head_policy):
    a = admit("a", {"name": "test_per_head_budgets", "budget": 8}, prompt_len=5, row=3)
    a.prefix_len = 5
    meta = runtime.build(decode_batch(["a"], [3], [9]))  # 9 tokens: step 3 of the decode
    (group,) = meta.region.groups
    assert group.inputs["echo"].tolist() == [[3, 3, 0]]
    batch = group.batch(layer=1, num_kv_heads=H)
    assert batch.budget.tolist() == [[18, 19]]  # 8 + 10 * layer + head
    assert batch.pool_rows.tolist() == [3] and batch.max_rows == 8
    assert batch.inputs is group.inputs


def test_after_step_counts_retained_tokens_and_ends_overflowed_requests(runtime):
    a = admit("a", {"name": "h2o", "budget": 8}, prompt_len=5, row=3)
    b = admit("b", {"name": "streaming", "budget": 6}, prompt_len=7, row=5)
    a.prefix_len, b.prefix_len = 5, 7
    runtime.build(decode_batch(["a", "b"], [3, 5], [6, 8]))  # binds both rows, flushes the table
    region = RUNTIME.region
    pages_a = region._owned["a"].pages
    region.valid[pages_a[0, 0, 0], :3] = True  # 3 slots in one (layer, head), P in another
    region.valid[pages_a[1, 1, 0], :] = True
    RUNTIME.overflow_flags[5] = True  # b found no free slot in some step
    RUNTIME.after_step(force=True)
    assert a.reported_tokens == (3 + P) // (L * H) and not a.overflowed
    assert a.reported_bytes == (3 + P) * region.config.bytes_per_page // P
    assert b.overflowed and b.sgl_req.to_finish is not None  # ended with a 503, a untouched
    # Counts taken before a request ended are dropped for it: end() settled its gauges.
    reported = a.reported_tokens
    RUNTIME._snapshot = ([a], torch.tensor([[10 * L * H], [0], [0]]), None)  # held, overflow, bytes
    RUNTIME.requests.pop("a")
    RUNTIME.after_step()
    assert a.reported_tokens == reported and RUNTIME._snapshot is None


def test_a_compressing_request_is_refused_by_name_where_the_engine_runs_another_attention_backend():
    """Without kvsieve's backend there is no region: admission refuses a
    compressing kv_policy (naming it) rather than running it as `full`."""
    from kvsieve.policies.spec import KVPolicyError

    assert RUNTIME.region is None
    RUNTIME.admit("plain", {"kv_policy": "full"}, prompt_len=4)
    with pytest.raises(KVPolicyError, match="'h2o' compresses, and this engine does not run kvsieve's attention"):
        RUNTIME.admit("h2o", {"kv_policy": {"name": "h2o", "budget": 16}}, prompt_len=4)
    assert not RUNTIME.requests


def test_rows_whose_decision_is_not_due_only_observe(runtime, monkeypatch):
    # rkv decides every `buffer` steps (Policy.deciding_rows): rows at
    # different steps split into a group that decides (its keys gathered,
    # select_decode) and one that only observes (observe_decode); each
    # subset carries its rows' budgets, steps, parameters and inputs.
    # (Unpadded here; tests/test_decision_buckets.py pads the deciding group.)
    rkv = get_policy("rkv")
    monkeypatch.setattr(rkv, "pads_decisions", False)
    for rid, row in (("a", 1), ("b", 2), ("c", 3)):
        req = admit(rid, {"name": "rkv", "budget": 8, "params": {"buffer": 4}}, prompt_len=5, row=row)
        req.prefix_len = 5
    # seq_len - 1 - prompt_len: steps 3 and 7 are due (buffer 4), step 4 is not.
    meta = runtime.build(decode_batch(["a", "b", "c"], [1, 2, 3], [9, 10, 13]))
    by_action = {g.action: g for g in meta.region.groups}
    assert sorted(by_action) == ["decide", "observe"]
    decide, observe = by_action["decide"], by_action["observe"]
    assert decide.members == [0, 2] and decide.rows.tolist() == [0, 2]
    assert decide.step.tolist() == [3, 7] and decide.pool_rows.tolist() == [1, 3]
    assert decide.params["buffer"].tolist() == [4, 4]
    assert observe.members == [1] and observe.step.tolist() == [4] and observe.pool_rows.tolist() == [2]
    # All due: one group; none due and nothing to observe (streaming decides every step): no split.
    meta = runtime.build(decode_batch(["a", "c"], [1, 3], [13, 17]))
    assert [g.action for g in meta.region.groups] == ["decide"] and meta.region.groups[0].members == [0, 1]
    meta = runtime.build(decode_batch(["a", "b"], [1, 2], [10, 10]))
    assert [g.action for g in meta.region.groups] == ["observe"]
    # Padded to its bucket (8 rows, more than the group): the whole group decides.
    monkeypatch.setattr(rkv, "pads_decisions", True)
    meta = runtime.build(decode_batch(["a", "b", "c"], [1, 2, 3], [17, 18, 21]))
    assert [g.action for g in meta.region.groups] == ["decide"] and meta.region.groups[0].members == [0, 1, 2]


def test_decisions_that_read_keys_come_in_row_chunks_within_the_scratch_bound(monkeypatch):
    import torch

    from kvsieve.policies import get_policy
    from kvsieve.radix_ext.step_meta import PolicyGroup, chunk_key_readers, decision_rows_limit

    # 4 heads x 1,088 slots x 128 dims x 2 bytes: ~1.1 MB of keys a row.
    monkeypatch.setenv("KVSIEVE_DECISION_SCRATCH_MB", "128")
    assert decision_rows_limit(4, 1088, 128, 2) == 112  # 120 rows fit; a row_bucket size below
    monkeypatch.setenv("KVSIEVE_DECISION_SCRATCH_MB", "3")
    assert decision_rows_limit(4, 1088, 128, 2) == 2
    monkeypatch.setenv("KVSIEVE_DECISION_SCRATCH_MB", "0")
    with pytest.raises(ValueError, match="KVSIEVE_DECISION_SCRATCH_MB"):
        decision_rows_limit(4, 1088, 128, 2)

    def group(name, n, action="decide"):
        t = torch.arange(n)
        return PolicyGroup(policy=get_policy(name)(), rows=t, budget=t, step=t, params={"x": t}, maxima={},
                           inputs={}, pool_rows=t, members=list(range(n)), action=action,
                           requests=[f"r{i}" for i in range(n)])

    # crystalcache reads keys too but decides whole (its snapshot is keyed by the group).
    out = chunk_key_readers([group("rkv", 5), group("streaming", 5), group("rkv", 5, "observe"),
                             group("crystalcache", 5)], lambda g: 2)
    assert [(g.policy.name, g.action, g.members) for g in out] == [
        ("rkv", "decide", [0, 1]), ("rkv", "decide", [2, 3]), ("rkv", "decide", [4]),
        ("streaming", "decide", [0, 1, 2, 3, 4]), ("rkv", "observe", [0, 1, 2, 3, 4]),
        ("crystalcache", "decide", [0, 1, 2, 3, 4])]
    assert [g.rows.tolist() for g in out[:3]] == [[0, 1], [2, 3], [4]]
    assert out[2].requests == ["r4"] and out[1].params["x"].tolist() == [2, 3]
    # The bound is the group's own: a group of narrow rows is cut into fewer chunks.
    wide, narrow = group("rkv", 5), group("skipkv", 5)
    wide.width, narrow.width = 68, 17
    monkeypatch.setenv("KVSIEVE_DECISION_SCRATCH_MB", "128")
    out = chunk_key_readers([wide, narrow], lambda g: decision_rows_limit(4, g.width * 16, 128, 2))
    assert [len(g.members) for g in out] == [5, 5]
    monkeypatch.setenv("KVSIEVE_DECISION_SCRATCH_MB", "1")  # rows of 1.1 MB (wide) and 0.27 MB (narrow)
    out = chunk_key_readers([wide, narrow], lambda g: decision_rows_limit(4, g.width * 16, 128, 2))
    assert [(g.policy.name, len(g.members)) for g in out] == [("rkv", 1)] * 5 + [("skipkv", 2), ("skipkv", 2),
                                                                                  ("skipkv", 1)]


def test_width_buckets_step_by_four_then_four_per_doubling():
    from kvsieve.radix_ext.step_meta import width_bucket

    assert [width_bucket(c) for c in (1, 4, 5, 17, 68, 127, 128)] == [4, 4, 8, 20, 68, 128, 128]
    assert [width_bucket(c) for c in (129, 160, 161, 256, 257, 274, 700)] == [160, 160, 192, 256, 320, 320, 768]
    # Never below what was asked, never more than a quarter above it past WIDE_FROM.
    for c in range(1, 3000):
        w = width_bucket(c)
        assert w >= c and (c <= 128 or w <= c * 1.25)


def test_a_steps_width_grows_geometrically_sooner_than_a_groups():
    from kvsieve.radix_ext.step_meta import STEP_WIDE_FROM, step_width_bucket, width_bucket

    assert [step_width_bucket(c) for c in (1, 5, 17, 32, 33, 41, 64, 65, 68, 81, 129)] == \
        [4, 8, 20, 32, 40, 48, 64, 80, 80, 96, 160]
    # A row growing a column every 16 tokens from 512 to 2,560 tokens widens
    # the step 9 times, not the 25 times of WIDTH_STEP columns.
    assert len({step_width_bucket(c) for c in range(33, 161)}) == 9
    assert len({width_bucket(c) for c in range(33, 161)}) == 25
    for c in range(1, 3000):
        w = step_width_bucket(c)
        assert w >= c and (c <= STEP_WIDE_FROM or w <= c * 1.25)


def test_a_padded_decode_width_is_held_while_the_widest_rows_narrow_by_less_than_half():
    import torch

    from kvsieve.radix_ext.step_meta import StepBuilder

    steps = StepBuilder(pages=None, req_to_token=torch.zeros(1, 1), device="cpu", pad_rows=True)
    widths = [steps._decode_width(c) for c in (17, 20, 21, 274, 200, 161, 129, 100, 40, 17, 18)]
    # Growing: every bucket. Narrowing: 320 held down to 161 (bucket 192 > 160);
    # 129 (bucket 160, half of 320) takes a new width, held at 100 (> 80);
    # 40 and 17 are under half of it and start over.
    assert widths == [20, 20, 24, 320, 320, 320, 160, 160, 40, 20, 20]


def test_a_policy_that_only_selects_from_the_prompt_forms_no_decode_group(runtime):
    # snapkv decides at prefill only: its decode rows store and attend in
    # no group, and a step of them alone asks for no observations.
    a = admit("a", {"name": "snapkv", "budget": 8}, prompt_len=5, row=3)
    b = admit("b", {"name": "h2o", "budget": 8}, prompt_len=5, row=4)
    a.prefix_len = b.prefix_len = 5
    mixed = runtime.build(decode_batch(["a", "b"], [3, 4], [6, 6])).region
    assert mixed.batch_index.tolist() == [0, 1]  # both rows in the pass
    assert [g.policy.name for g in mixed.groups] == ["h2o"]
    alone = runtime.build(decode_batch(["a"], [3], [7])).region
    assert alone.groups == [] and alone.needs == Need.NONE
    assert get_policy("snapkv").acts_during_decode() is False
    assert all(get_policy(n).acts_during_decode() for n in policy_names()
               if get_policy(n).compresses and n != "snapkv")


def test_a_groups_lists_and_parameters_go_to_the_device_in_one_transfer_each(runtime, monkeypatch):
    # Each host-to-device transfer is one observations.to_device call: the
    # step's groups get their four index lists in one (all groups together),
    # their parameters in one per dtype (before: one per list and per parameter).
    from kvsieve.policies import observations

    calls = []
    real = observations.to_device
    monkeypatch.setattr(observations, "to_device",
                        lambda values, dtype, device: calls.append((len(values), dtype)) or real(values, dtype, device))
    rkv = get_policy("rkv")
    rows = [rkv.Params(), rkv.Params(buffer=3)]
    params, _ = rkv.batch_params(rows, "cpu")
    kinds = {isinstance(getattr(rows[0], n), float) for n in rkv.tensor_params()}
    assert len(kinds) == 2 and len(calls) == 2, calls  # int and float parameters: two transfers
    for name in rkv.tensor_params():
        tensor, values = params[name], [getattr(r, name) for r in rows]
        assert tensor.tolist() == pytest.approx(values)
        assert tensor.dtype == (torch.float32 if isinstance(values[0], float) else torch.int64)

    for rid, row, policy in (("a", 3, {"name": "h2o", "budget": 8}), ("b", 4, {"name": "h2o", "budget": 6}),
                             ("c", 5, {"name": "rkv", "budget": 8})):
        admit(rid, policy, prompt_len=5, row=row).prefix_len = 5
    calls.clear()
    meta = runtime.build(decode_batch(["a", "b", "c"], [3, 4, 5], [6, 6, 6]))
    groups = {g.policy.name: g for g in meta.region.groups}
    assert [groups["h2o"].rows.tolist(), groups["h2o"].budget.tolist(), groups["h2o"].step.tolist(),
            groups["h2o"].pool_rows.tolist()] == [[0, 1], [8, 6], [0, 0], [3, 4]]
    assert [groups["rkv"].rows.tolist(), groups["rkv"].budget.tolist(), groups["rkv"].pool_rows.tolist()] == [
        [2], [8], [5]]
    assert (4 * 3, torch.int64) in calls, calls  # every group's four lists at once


def test_a_classes_parameters_are_built_once_while_its_rows_are_the_same(runtime, monkeypatch):
    cls = get_policy("rkv")
    calls = []
    real = cls.batch_params.__func__

    def counted(klass, rows, device="cpu"):
        calls.append(len(rows))
        return real(klass, rows, device)

    monkeypatch.setattr(cls, "batch_params", classmethod(counted))
    a, b, c = (cls.Params(window=w) for w in (8, 16, 32))
    first, _ = runtime._batch_params(cls, [a, b])
    again, maxima = runtime._batch_params(cls, [a, b])
    assert calls == [2]  # the same parameter objects: reused
    assert all(torch.equal(first[k], again[k]) for k in first) and maxima["window"] == 16
    again["window"] = None  # a holder replacing an entry does not reach the next step's dict
    assert runtime._batch_params(cls, [a, b])[0]["window"].tolist() == [8, 16]
    other, maxima = runtime._batch_params(cls, [a, c])  # a row changed: built anew
    assert calls == [2, 2] and other["window"].tolist() == [8, 32] and maxima["window"] == 32
    runtime._batch_params(cls, [a])
    assert calls == [2, 2, 1]


def test_a_steady_class_gathers_its_parameters_once_for_the_rows_a_group_picks(runtime, monkeypatch):
    # A class cut into deciding and observing rows gathers its parameters
    # for each part once, and reuses them while its rows and the cut repeat
    # (StepBuilder._materialize); a group of all its rows in order gathers none.
    from kvsieve.radix_ext import step_meta

    rkv = get_policy("rkv")
    monkeypatch.setattr(rkv, "pads_decisions", False)
    gathered = []
    take = step_meta.RowIndex.take
    monkeypatch.setattr(step_meta.RowIndex, "take", lambda self, t: gathered.append(t.shape) or take(self, t))
    for rid, row, window in (("a", 1, 8), ("b", 2, 16), ("c", 3, 32)):
        req = admit(rid, {"name": "rkv", "budget": 8, "params": {"buffer": 4, "window": window}}, prompt_len=5,
                    row=row, new_tokens=16)
        req.prefix_len = 5
    per_group = len(rkv.batch_params([rkv.Params()], "cpu")[0])  # its parameters (rkv has no step inputs)

    def step(seq_lens):
        gathered.clear()
        meta = runtime.build(decode_batch(["a", "b", "c"], [1, 2, 3], seq_lens))
        return {g.action: g for g in meta.region.groups}

    first = step([9, 10, 13])  # steps 3, 4, 7: a and c decide
    assert len(gathered) == 2 * per_group
    assert first["decide"].params["window"].tolist() == [8, 32] and first["observe"].params["window"].tolist() == [16]
    assert first["decide"].budget.tolist() == [8, 8] and first["observe"].step.tolist() == [4]
    again = step([13, 14, 17])  # steps 7, 8, 11: the same cut, nothing gathered
    assert gathered == []
    assert again["decide"].step.tolist() == [7, 11] and again["observe"].step.tolist() == [8]
    assert again["decide"].params["window"].tolist() == [8, 32] and again["observe"].params["window"].tolist() == [16]
    whole = step([12, 16, 20])  # steps 6, 10, 14: none due, one group of every row
    assert gathered == [] and whole["observe"].params["window"].tolist() == [8, 16, 32]
    swapped = step([10, 13, 14])  # steps 4, 7, 8: the same two parts, the other one decides
    assert gathered == []
    assert swapped["decide"].params["window"].tolist() == [16] and swapped["observe"].params["window"].tolist() == [8, 32]
    other = step([9, 10, 11])  # steps 3, 4, 5: another cut, gathered anew
    assert len(gathered) == 2 * per_group
    assert other["decide"].params["window"].tolist() == [8] and other["observe"].params["window"].tolist() == [16, 32]


def test_padded_rows_of_a_cut_group_copy_its_first_row_but_read_the_null_table_row(runtime, monkeypatch):
    from kvsieve.radix_ext.step_meta import PAD_POOL_ROW

    rkv = get_policy("rkv")
    monkeypatch.setattr(rkv, "pads_decisions", False)
    runtime.pad_rows = True
    for rid, row, window in (("a", 1, 8), ("b", 2, 16), ("c", 3, 32)):
        admit(rid, {"name": "rkv", "budget": 8, "params": {"buffer": 4, "window": window}}, prompt_len=5,
              row=row, new_tokens=16).prefix_len = 5
    meta = runtime.build(decode_batch(["a", "b", "c"], [1, 2, 3], [10, 9, 13]))  # b and c decide
    groups = {g.action: g for g in meta.region.groups}
    decide, observe = groups["decide"], groups["observe"]
    assert decide.members == [1, 2] and observe.members == [0, 3]  # the class's 3 rows padded to 4
    assert observe.requests[1] is None and observe.rows.tolist() == [0, 3]
    assert observe.pool_rows.tolist() == [1, PAD_POOL_ROW]
    assert observe.step.tolist() == [4, 4] and observe.budget.tolist() == [8, 8]
    assert observe.params["window"].tolist() == [8, 8]
    assert meta.region.real == 3 and meta.region.pool_rows.shape[0] == 16


def test_only_rows_that_read_pv_norm_ask_the_kernel_for_it():
    """|p*v| has a bit of its own: in a mixed batch with LongFlow the other
    observing rows (h2o's attention, ThinKV's sparsity) do not load their
    values' norms; each bit is set in the first layer and, shifted, the later
    ones, unless the policy observes the first layer only."""
    later = step_meta.LATER_LAYERS_SHIFT
    both = step_meta.OBSERVE_REGION | step_meta.OBSERVE_PV
    longflow = step_meta.observe_bits_of(get_policy("longflow").needs)
    assert longflow == both | both << later
    h2o = step_meta.observe_bits_of(get_policy("h2o").needs)
    assert h2o == step_meta.OBSERVE_REGION | step_meta.OBSERVE_REGION << later
    thinkv = step_meta.observe_bits_of(get_policy("thinkv").needs)
    assert thinkv == step_meta.OBSERVE_SPARSITY | step_meta.OBSERVE_SPARSITY << later
    assert step_meta.observe_bits_of(Need.PV_NORM, first_layer_only=True) == both
    assert step_meta.observe_bits_of(Need.KEYS | Need.TOKEN_IDS) == 0
