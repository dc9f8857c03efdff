"""Tensor parallelism 2: a real `kvsieve serve --tp-size 2` on CPU
(two SGLang ranks, each holding one of the tiny Llama's two kv heads, gloo
collectives) against the session's TP-1 server on the same model, one case
per registered policy (tests/tp_cases.py). Ranks
agree on what is evicted when every request's greedy output and kv_usage
equal TP 1's: a layer-wide LongFlow eviction, a ThinKV thought type or a
CrystalCache index set decided on one rank's heads alone diverges (it did
before the decisions reduced over `PolicyBatch.heads`). kv_usage and the
eviction counters are counted once, the bytes over both ranks."""

import pytest

from kvsieve.service.engine import cpu_thread_binding
from conftest import start_server
from test_compressed import complete, metric, region_idle
from tp_cases import tp_cases, tp_prompt
from kvsieve.policies.registry import policy_names

CASES = tp_cases()
USAGE = ("private_tokens", "retained_tokens", "evicted_tokens", "eviction_events", "retained_kv_bytes")


@pytest.fixture(scope="module")
def tp2_server(tiny_llama, tmp_path_factory):
    # Region graphs in "rerun" mode (a replay runs the captured pass again,
    # as a CUDA replay would): under TP the per-head policies' passes
    # replay, the ones with a collective run eagerly.
    server = start_server(tmp_path_factory.mktemp("tp2"), "--model", str(tiny_llama), "--tp-size", "2",
                          "--max-total-tokens", "4096", env={"KVSIEVE_REGION_GRAPHS": "rerun"})
    yield server
    server.stop()


def test_tp2_equals_tp1_token_for_token_and_counts_usage_once(tp2_server, llama_server):
    evicted = 0
    for i, (policy, tokens) in enumerate(CASES):
        one = complete(llama_server, tp_prompt(i, policy), policy, max_tokens=tokens)
        two = complete(tp2_server, tp_prompt(i, policy), policy, max_tokens=tokens)
        assert two["choices"][0]["token_ids"] == one["choices"][0]["token_ids"], policy
        for key in USAGE:
            assert two["kv_usage"].get(key) == one["kv_usage"].get(key), (policy, key)
        evicted += two["kv_usage"]["evicted_tokens"]
    assert evicted > 0
    # The counter sums what every request reported, once (not once per rank).
    assert metric(tp2_server, "kvsieve_evicted_tokens_total") == evicted
    assert region_idle(tp2_server)
    # Per-layer region graphs replayed; the whole-forward graphs stay off under TP.
    assert metric(tp2_server, "kvsieve_decode_graph_replays_total", graph="region") > 0
    assert metric(tp2_server, "kvsieve_decode_graph_replays_total", graph="forward") == 0


def test_under_tp_only_passes_without_a_collective_are_captured():
    from types import SimpleNamespace

    from kvsieve.policies import get_policy
    from kvsieve.policies.observations import HeadShards
    from kvsieve.radix_ext import head_parallel, region_graphs

    # A decide pass of a step without step inputs (CrystalCache's keep step is
    # capturable alone, its snapshot step is not: decide_graph_safe).
    groups = {name: SimpleNamespace(policy=get_policy(name), action="decide", input_names=frozenset)
              for name in policy_names()}
    alone = {name for name, g in groups.items() if region_graphs.capturable(g)}
    saved = head_parallel.SHARDS
    head_parallel.SHARDS = HeadShards(size=2, rank=0)
    try:
        under_tp = {name for name, g in groups.items() if region_graphs.capturable(g)}
    finally:
        head_parallel.SHARDS = saved
    assert {"longflow", "thinkv"} <= alone and "streaming" in under_tp
    assert under_tp == {name for name in alone if not get_policy(name).crosses_heads}
    assert not under_tp & {"longflow", "thinkv"}


def test_every_registered_policy_has_a_tp_case():
    covered = {p if isinstance(p, str) else p["name"] for p, _ in CASES}
    assert covered == set(policy_names())


def test_cpu_ranks_get_equal_shares_of_the_cores():
    assert cpu_thread_binding([0, 1], 2) == "0|1"
    assert cpu_thread_binding([0, 1, 2, 3, 4, 5, 6, 7], 2) == "0-3|4-7"
    assert cpu_thread_binding([0, 2, 4, 6], 2) == "0,2|4,6"
    with pytest.raises(ValueError, match="tp_size=4"):
        cpu_thread_binding([0, 1], 4)
