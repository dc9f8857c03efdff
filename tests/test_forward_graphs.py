"""Whole-forward graphs of all-compressed decode steps (radix_ext/forward_graphs.py).

Which steps replay the whole decoder stack (host side, on the real step
builder), and a real `kvsieve serve` on CPU with KVSIEVE_REGION_GRAPHS=rerun:
there a "graph" replays by running the recorded function again, with the
arguments it was recorded with (the capture-time ForwardBatch included),
which is what a CUDA graph's replay executes; so a decoder pass that read
the batch of the step it was recorded in, instead of the static metadata,
would give different tokens here. Real CUDA capture and replay:
bench/forward_graphs_check.py on a GPU (docs/gpu-kernels.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsieve.policies import Observations, get_policy, policy_names
from kvsieve.policies.skipkv import steering
from kvsieve.radix_ext.forward_graphs import ForwardGraphs, step_is_whole
from kvsieve.radix_ext.region_graphs import RegionGraphs, observation_shape
from kvsieve.radix_ext.runtime import RUNTIME

from conftest import start_server
from test_compressed import complete, complete_together, metric, region_idle
from test_step_meta import L, admit, decode_batch, runtime  # noqa: F401  (fixture)

GEN = 48
#: Graph-safe decode-time policies (the ones whose steps replay), one row each.
GRAPH_SAFE = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe]


def policy_for(name: str) -> dict:
    return {"name": name, "budget": 8}


def prompt_for(index: int) -> list[int]:
    # First ids 336..328: no other test on the shared server starts a prompt
    # there (a shared first token is a radix hit that changes their kv_usage).
    return [336 - index, 12, 57, 203, 9, 88, 146, 31, 270, 64]


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        self.calls = []

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        self.calls.append(forward_batch)
        return input_ids.float() + positions.float()


def capture_all(region) -> None:
    """Mark every segment of the region graphs' current step as captured in every layer."""
    region.current.graphs = {layer: object() for layer in range(L)}
    shape = observation_shape(next(iter(region.current.obs.values()), None))  # group graphs are kept per view shape
    for _, entry in region.step_groups:
        entry.graphs = {(layer, shape): object() for layer in range(L)}


def _two_rows(runtime):
    for rid, row in (("a", 3), ("b", 5)):
        admit(rid, {"name": "h2o", "budget": 8}, prompt_len=5, row=row).prefix_len = 5


def test_a_step_replays_whole_only_when_every_row_is_compressed_and_captured(runtime):
    _two_rows(runtime)  # "f" below is not a compressed request: a `full` row on SGLang's backend
    whole = runtime.build(decode_batch(["a", "b"], [3, 5], [6, 6]))
    assert step_is_whole(whole, batch_size=2)
    mixed = runtime.build(decode_batch(["a", "f", "b"], [3, 6, 5], [7, 7, 7]))
    assert mixed.pool_batch is not None and not step_is_whole(mixed, batch_size=3)
    assert not step_is_whole(None, batch_size=2)

    region = RegionGraphs(rerun=True)
    graphs = ForwardGraphs(Decoder(), region, num_layers=L)
    # Shapes seen twice: the entries exist (9); the composition made
    # COMPOSITION_REPEATS (3) of the last steps with an entry (9, 10, 11).
    for seq in (8, 9, 10, 11):
        step = runtime.build(decode_batch(["a", "b"], [3, 5], [seq, seq]))
        region.begin_step(step, needs_keys=False)
        graphs.begin_step(step, batch_size=2)
    assert region.current is not None and graphs.active is None  # its layers are not all captured yet
    capture_all(region)
    graphs.begin_step(step, batch_size=2)
    assert graphs.active == region.composition
    table = steering.TABLE
    steering.TABLE = SimpleNamespace(live={3: 1})  # a steered request: its hooks read host state
    try:
        graphs.begin_step(step, batch_size=2)
        assert graphs.active is None
    finally:
        steering.TABLE = table


def test_full_rows_beside_compressed_ones_join_the_pass_as_pool_only_rows(runtime):
    _two_rows(runtime)
    runtime.fold_pool_rows, runtime.fold_max_tokens = True, 64
    runtime.pad_rows = True  # as where graphs replay: the step padded to a multiple of ROWS_STEP
    batch = decode_batch(["a", "f", "b"], [3, 6, 5], [7, 9, 7])
    batch.out_cache_loc = torch.tensor([0, 4321, 0])  # SGLang's slot for f's new token; 0: compressed rows
    step = runtime.build(batch)
    rows = step.region
    # Every row, in batch order; f is in no group and reads no region page.
    assert step.pool_batch is None and step_is_whole(step, batch_size=3)
    assert rows.real == 3 and rows.pool_only == 1 and rows.batch_index.tolist()[:3] == [0, 1, 2]
    assert rows.pool_rows.tolist()[:3] == [3, 0, 5]
    own = int(rows.columns[0])  # a's own columns; the step's width is padded past them with null pages
    null = RUNTIME.region.null_page
    assert (rows.tables[1] == null).all() and (rows.tables[0, ..., :own] != null).all()
    assert [g.members for g in rows.groups] == [[0, 2]]
    # Its prefix is every token it holds, this step's included, from its own req_to_token row.
    assert rows.prefix_lens.tolist()[:3] == [5, 9, 5]
    assert torch.equal(rows.prefix_slots[1, :9], torch.arange(6 * 2000, 6 * 2000 + 9))
    assert rows.out_slots.tolist()[:3] == [0, 4321, 0]
    # Padded rows (to a multiple of ROWS_STEP): no request, the null pages'
    # table row, no prefix, no columns or observations, SGLang's dummy slot.
    pads = rows.pool_rows.shape[0] - rows.real
    assert pads > 0 and rows.tables.shape[0] == rows.prefix_slots.shape[0] == rows.real + pads
    assert rows.pool_rows.tolist()[3:] == [0] * pads and rows.batch_index.tolist()[3:] == [0] * pads
    assert rows.prefix_lens.tolist()[3:] == [0] * pads and not rows.prefix_mask[3:].any()
    assert not rows.prefix_slots[3:].any() and (rows.tables[3:] == RUNTIME.region.null_page).all()
    assert rows.columns.tolist()[3:] == rows.observe.tolist()[3:] == [0] * pads
    assert rows.out_slots.tolist()[3:] == rows.positions.tolist()[3:] == [0] * pads
    # A batch of `full` rows only is SGLang's, and so is one with a `full`
    # row longer than the planned prefix tables, or a row being aborted.
    assert runtime.build(decode_batch(["f", "g"], [6, 7], [9, 9])) is None
    longer = runtime.build(decode_batch(["a", "f", "b"], [3, 6, 5], [8, 65, 8]))
    assert longer.pool_batch_index.tolist() == [1] and longer.region.pool_only == 0
    RUNTIME.requests["b"].overflowed = True
    mixed = runtime.build(decode_batch(["a", "f", "b"], [3, 6, 5], [8, 10, 8]))
    assert mixed.pool_batch_index.tolist() == [1] and mixed.region.pool_only == 0


def test_the_captured_stack_reads_static_inputs_and_runs_once_per_step(runtime):
    _two_rows(runtime)
    region = RegionGraphs(rerun=True)
    decoder = Decoder()
    after = []  # after_stack's calls: the backend's deferred groups and TBQ flush of every layer

    def after_stack(replayed: bool) -> None:
        after.append(replayed)
        if replayed:
            # What a group graph does whose recorded temporaries share blocks
            # with the stack's output (the shared pool): the hidden states
            # the step returned must not change.
            for captured in graphs.cache.values():
                captured.output["hidden"].fill_(float("nan"))

    graphs = ForwardGraphs(decoder, region, num_layers=L, after_stack=after_stack)
    fb_seen, steps = [], []
    for seq in (8, 9, 10, 11, 12):
        step = runtime.build(decode_batch(["a", "b"], [3, 5], [seq, seq]))
        if seq == 12:  # a TBQ group flush in this step: it replays whole all the same
            step.region.flush_rows, step.region.flush_format = torch.tensor([1]), torch.tensor([2])
        assert step_is_whole(step, batch_size=2)
        steps.append(step)
        region.begin_step(step, needs_keys=False)
        if region.current is not None and seq >= 10:  # step 9 made the entries and captured their layers
            capture_all(region)
        graphs.begin_step(step, batch_size=2)
        fb = SimpleNamespace(seq=seq)
        fb_seen.append(fb)
        ids, pos = torch.tensor([seq, 2 * seq]), torch.tensor([100, 200])
        hidden = decoder(ids, pos, fb)
        assert hidden.tolist() == [seq + 100.0, 2 * seq + 200.0]
    # Steps 11 and 12 (9 made the entries; 9, 10 and 11 made the composition recur).
    assert graphs.captures == 1 and graphs.replays == 2
    # After every stack, eager or replayed: whether it was a replay (the
    # backend then flushes the live step it built, never the entry's static one).
    assert after == [False, False, False, True, True]
    # Replays ran the recorded pass with the capture-time batch, on static inputs.
    assert decoder.calls[-1] is fb_seen[3] and decoder.calls[-2] is fb_seen[3]
    # A forward call that does not follow begin_step (SGLang's own graphs at start-up) passes through.
    assert decoder(torch.tensor([1]), torch.tensor([2]), "other").tolist() == [3.0]
    assert decoder.calls[-1] == "other"


@pytest.fixture(scope="module")
def rerun_server(tiny_llama, tmp_path_factory):
    """The tiny Llama with region and forward graphs whose replay reruns the recorded function."""
    server = start_server(tmp_path_factory.mktemp("rerun-graphs"), "--model", str(tiny_llama),
                          env={"KVSIEVE_REGION_GRAPHS": "rerun", "KVSIEVE_FORWARD_GRAPHS": "1"})
    yield server
    assert server.stop() == 0, server.log()


def test_a_batch_replayed_from_whole_forward_graphs_equals_its_solo_runs(llama_server, rerun_server):
    assert len(GRAPH_SAFE) >= 5
    # One row of each policy, and three of streaming: its group is padded to
    # 4 rows (step_meta.row_bucket), so the replayed stack runs a padded row.
    # The two extra ones roll every step (buffer 1) beside the default's 16:
    # the deciding group is padded with a row not due (it evicts nothing).
    # (With the default, prompt 8 meets a tie at token 15, fp32 logits
    # 4.2385 and 4.2313, one bf16 value, where the batch may take the other.)
    names = GRAPH_SAFE + ["streaming", "streaming"]
    policies = [policy_for(name) for name in GRAPH_SAFE] + [{**policy_for("streaming"), "params": {"buffer": 1}}] * 2
    solo = [complete(llama_server, prompt_for(i), policy, max_tokens=GEN)["choices"][0]["token_ids"]
            for i, policy in enumerate(policies)]

    batched = complete_together(rerun_server, [(prompt_for(i), policy) for i, policy in enumerate(policies)],
                                max_tokens=GEN)
    for i, name in enumerate(names):
        assert batched[i]["choices"][0]["token_ids"] == solo[i], name
    assert any(b["kv_usage"]["evicted_tokens"] > 0 for b in batched)
    # thinkv's TBQ flushes a group every 16 steps: those steps replay whole
    # too, and flush every layer after the stack.
    assert batched[names.index("thinkv")]["kv_usage"]["tbq"] is True
    assert metric(rerun_server, "kvsieve_decode_padded_rows_total") >= GEN // 2
    assert metric(rerun_server, "kvsieve_decode_graph_captures_total", graph="forward") >= 1
    assert metric(rerun_server, "kvsieve_decode_graph_replays_total", graph="forward") >= GEN // 4
    assert region_idle(rerun_server)


#: Largest fp32 logit gap between two tokens that counts as a tie: both
#: round to the same bf16 value near the tiny model's logits (~4, ulp 1/32).
TIE = 1 / 64


def diverges_at_a_tie(model_dir, prompt: list, solo: list, batched: list) -> bool:
    """Whether `batched` equals `solo` up to a first difference where the
    model's two tokens are tied (reference: Hugging Face, fp32, the common
    prefix as input): a `full` row's batch-variant rounding (the module
    docstring of forward_graphs.py) may pick either."""
    import transformers

    at = next(i for i, (a, b) in enumerate(zip(solo, batched)) if a != b)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + solo[:at]])).logits[0, -1]
    two = set(torch.topk(logits, 2).indices.tolist())
    return two == {solo[at], batched[at]} and abs(float(logits[solo[at]] - logits[batched[at]])) <= TIE


def batch_equals_solo_runs(solo_server, batch_server, prompts, policies, labels, model_dir=None) -> tuple[list, float]:
    """Each prompt alone on `solo_server`, then all in one batch on
    `batch_server`: every row's tokens equal its solo run (a `full` row's
    may part from it at a tie of its two best tokens, checked on
    `model_dir`). The batch's answers and the whole-stack replays it made."""
    solo = [complete(solo_server, p, k, max_tokens=GEN)["choices"][0]["token_ids"] for p, k in zip(prompts, policies)]
    before = metric(batch_server, "kvsieve_decode_graph_replays_total", graph="forward")
    batched = complete_together(batch_server, list(zip(prompts, policies)), max_tokens=GEN)
    for prompt, policy, answer, tokens, label in zip(prompts, policies, batched, solo, labels):
        got = answer["choices"][0]["token_ids"]
        full = policy is None or policy == {"name": "full"}
        assert got == tokens or (full and model_dir is not None and diverges_at_a_tie(model_dir, prompt, tokens, got)), \
            (label, tokens, got)
    return batched, metric(batch_server, "kvsieve_decode_graph_replays_total", graph="forward") - before


def test_a_batch_with_full_rows_replays_whole_and_each_row_equals_its_solo_run(llama_server, rerun_server, tiny_llama):
    # `full` rows (named, and no kv_policy at all) beside compressed ones:
    # they run in kvsieve's pass as pool-only rows, so the step still
    # replays its whole stack; their new tokens go to the token pool.
    names = ["full", None, "h2o", "streaming", "full"]
    policies = [policy_for(n) if n not in ("full", None) else ({"name": "full"} if n else None) for n in names]
    prompts = [prompt_for(20 + i) for i in range(len(names))]
    # The last prompt's solo run meets a tie at token 31 (fp32 logits 4.2828
    # and 4.2779, one bf16 value): there the batch may take the other token.
    _, replays = batch_equals_solo_runs(llama_server, rerun_server, prompts, policies, names, model_dir=tiny_llama)
    assert metric(rerun_server, "kvsieve_decode_pool_only_rows_total") >= GEN
    assert replays >= GEN // 4
    assert region_idle(rerun_server)


def test_group_passes_stacked_over_layers_after_the_replayed_stack_equal_the_solo_runs(llama_server, rerun_server):
    # The groups run after the stack, each stacking-policy group's layers in
    # one call (radix_ext/layer_blocks.py; the plan is off on CPU, so all of
    # the tiny model's layers at once). rkv scoring as the paper reads the
    # query ring of each stacked layer; skipkv reads keys; longflow the
    # fused pass's |p*v|. Each row's tokens equal its solo run.
    policies = [{"name": "rkv", "budget": 8, "params": {"scoring": "paper"}}, policy_for("skipkv"),
                policy_for("longflow"), policy_for("h2o"), {"name": "rkv", "budget": 8, "params": {"scoring": "paper"}}]
    prompts = [prompt_for(40 + i) for i in range(len(policies))]
    batched, replays = batch_equals_solo_runs(llama_server, rerun_server, prompts, policies, policies)
    assert all(b["kv_usage"]["evicted_tokens"] > 0 for b in batched)
    # Evictions counted once per (row, layer) pass, stacked or not.
    assert [b["kv_usage"]["evicted_tokens"] for b in batched] == [
        complete(llama_server, p, k, max_tokens=GEN)["kv_usage"]["evicted_tokens"] for p, k in zip(prompts, policies)]
    assert replays >= GEN // 4
    assert region_idle(rerun_server)


def test_a_stack_that_cannot_be_recorded_runs_eagerly_from_then_on(runtime):
    _two_rows(runtime)

    class Unrecordable(RegionGraphs):
        def capture(self, static_pass):
            raise RuntimeError("operation not permitted when stream is capturing")

    region = Unrecordable(rerun=True)
    decoder = Decoder()
    graphs = ForwardGraphs(decoder, region, num_layers=L)
    for seq in (8, 9, 10, 11):
        step = runtime.build(decode_batch(["a", "b"], [3, 5], [seq, seq]))
        region.begin_step(step, needs_keys=False)
    capture_all(region)
    graphs.begin_step(step, batch_size=2)
    assert decoder(torch.tensor([1, 2]), torch.tensor([10, 20]), "fb").tolist() == [11.0, 22.0]
    assert decoder.forward == graphs.original and graphs.captures == 0 and decoder.calls == ["fb"]


def test_an_eager_step_defers_its_groups_over_every_layer_after_the_stack(runtime):
    """A step of new shapes has no graph entry and runs eagerly; where groups
    are deferred it defers too: each layer's observations wait in the planned
    buffers and each group then runs once over all layers (in blocks), not
    once per layer. KVSIEVE_EAGER_DEFER=0 (eager_defer False) keeps the groups
    inside the layers."""
    admit("a", {"name": "h2o", "budget": 8}, prompt_len=5, row=3).prefix_len = 5
    admit("b", {"name": "streaming", "budget": 8, "params": {"buffer": 1}}, prompt_len=5, row=5).prefix_len = 5
    step = runtime.build(decode_batch(["a", "b"], [3, 5], [8, 8]))
    layers = [SimpleNamespace(layer_id=i) for i in range(L)]
    calls = []
    backend = SimpleNamespace(step=step, decode_group_layers=lambda g, ls, obs: calls.append((g, ls, obs)))
    S = step.region.tables.shape[3] * RUNTIME.region.config.page_size
    attention = [torch.rand(2, RUNTIME.region.config.num_kv_heads, S) for _ in layers]

    region = RegionGraphs(rerun=True)
    region.defer_groups = region.eager_defer = True
    region.begin_step(step, needs_keys=False)
    assert region.current is None and region.defers_eagerly() and not region.deferred()  # first sight: eager
    for layer, att in zip(layers, attention):
        region.store_eager_layer(layer, Observations(attention=att))
    assert region.deferred()
    region.run_groups(backend)
    assert [g for g, _, _ in calls] == step.region.groups and len(calls) == 2
    for _, ls, obs in calls:
        assert ls == layers
        for o, att in zip(obs, attention):
            assert torch.equal(o.attention[:2], att)  # the layer's own, in its planned buffer

    # The same shapes again: an entry now (its segments defer as before); nothing kept from the eager step.
    region.begin_step(step, needs_keys=False)
    assert region.eager_obs == {} and region.current is not None and not region.defers_eagerly()
    fresh = RegionGraphs(rerun=True)
    fresh.defer_groups, fresh.eager_defer = True, False
    fresh.begin_step(step, needs_keys=False)
    assert fresh.current is None and not fresh.defers_eagerly()
