"""radix_ext/layer0_probe.py against a dense softmax: the chunked, head-by-head
probe of the first layer's prompt attention, fed in uneven extends (chunks
split across them), gives the saliency and edge set of
policies/crystalcache/prefill.py's saliency_and_edges on the dense [H, n, n]
probabilities (the private columns of the joint softmax with a shared
prefix); and crystalcache's prefill selection built on it keeps what
prefill_keep keeps."""

import math

import pytest
import torch

from kvsieve.policies.crystalcache.policy import CrystalCachePolicy, CrystalCacheParams, prompt_edges
from kvsieve.policies.crystalcache.prefill import prefill_keep, saliency_and_edges
from kvsieve.policies.base import ModelInfo, StepRow
from kvsieve.radix_ext import layer0_probe


def dense(q, k, pk, scale):
    """[Hq, n, n] private columns of the causal joint softmax over prefix + prompt."""
    n, Hq, _ = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    kk = k.repeat_interleave(G, dim=0).double()  # [Hq, n, D]
    logits = torch.einsum("qhd,hkd->hqk", q.double(), kk) * scale
    logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    if pk.shape[0]:
        pre = torch.einsum("qhd,phd->hqp", q.double(), pk.repeat_interleave(G, dim=1).double()) * scale
        logits = torch.cat([pre, logits], dim=-1)
    return torch.softmax(logits, dim=-1)[..., pk.shape[0]:]


def probe(q, k, pk, scale, chunk, extends):
    state = layer0_probe.ProbeState(q.shape[0], "cpu", chunk=chunk)
    at = 0
    for size in extends:
        layer0_probe.observe(state, q[at:at + size], k, pk, scale)
        at += size
    ids = list(range(q.shape[0]))
    holder = type("S", (), {})()
    setattr(holder, layer0_probe.ATTRIBUTE, state)
    return layer0_probe.collect([(holder, ids, 0, 10)])[0]


@pytest.mark.parametrize("n,prefix,chunk,extends", [
    (40, 0, 16, [40]),
    (40, 5, 16, [7, 20, 13]),  # chunks split across extends, a shared prefix
    (23, 3, 1024, [1, 22]),  # one chunk, shorter than CHUNK
])
def test_probe_equals_dense_saliency_and_edges(n, prefix, chunk, extends):
    g = torch.Generator().manual_seed(n + prefix)
    Hq, Hkv, D = 4, 2, 8
    q = torch.randn(n, Hq, D, generator=g) * 2
    k = torch.randn(Hkv, n, D, generator=g) * 2
    pk = torch.randn(prefix, Hkv, D, generator=g) * 2
    scale = 1 / math.sqrt(D)
    attn = dense(q, k, pk, scale)
    ref_saliency, ref_edges = saliency_and_edges(attn, chunk)
    pa = probe(q, k, pk, scale, chunk, extends)
    assert torch.allclose(pa.saliency.clamp(0.1, 20.0), ref_saliency, atol=1e-4)
    edges = prompt_edges(pa)
    assert edges.keys() == ref_edges.keys()
    for key, w in ref_edges.items():
        assert edges[key] == pytest.approx(w, abs=1e-4)


def test_prefill_selection_from_the_probe_keeps_what_prefill_keep_keeps():
    # 300 prompt tokens, a delimiter every ~7 tokens, budget 150 (> the 132 floor):
    # the policy's S1-S6 on the probe equals prefill_keep on the dense probabilities.
    n, Hq, Hkv, D = 300, 4, 2, 8
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(n, Hq, D, generator=g) * 2, torch.randn(Hkv, n, D, generator=g) * 2
    pk = torch.zeros(0, Hkv, D)
    ids = [(7 * i) % 50 if i % 7 else 99 for i in range(n)]
    delims = frozenset({99})
    ref = prefill_keep(dense(q, k, pk, 1 / math.sqrt(D)), ids, delims, budget=150, chunk=64)
    state = layer0_probe.ProbeState(n, "cpu", chunk=64)
    layer0_probe.observe(state, q, k, pk, 1 / math.sqrt(D))
    policy = CrystalCachePolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=2, num_kv_heads=Hkv, num_q_heads=Hq, head_dim=D,
                                delimiter_ids=delims))
    request = policy.begin_request(CrystalCacheParams(), 2, Hkv)
    setattr(request, layer0_probe.ATTRIBUTE, state)
    pa = layer0_probe.collect([(request, ids, 10, 150)])[0]  # base position 10: a shared prefix of 10
    inputs = policy.prompt_attention_inputs([pa], "cpu")
    kept = [10 + p for p in ref.dissolution.kept]
    table = inputs["keep"][0]
    assert (table[10:10 + n].nonzero().flatten() + 10).tolist() == kept
    assert len(kept) < n
    # The trunk table the decode phase starts from is read back at the next step.
    assert request.trunks is None
    policy.step_inputs([StepRow(state=request, step=0, pool_row=0, budget=150, prefill=False)], "cpu")
    assert request.trunks is not None and sorted(p for t in request.trunks.trunks for p in t) == kept
