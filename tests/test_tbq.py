"""Quantized pages (ThinKV's TBQ): the formats' round trip on random and on
real KV (SmolLM2-135M's own keys and values), attention error against bf16,
the storage (groups moved into typed pages, refilled after eviction, reset
on reuse) and its byte accounting."""

import pytest
import torch

from kvsieve.kernels import attention_ref
from kvsieve.kernels import kv_formats as kvf
from kvsieve.radix_ext import tbq_store
from kvsieve.radix_ext.pages import PageManager, RegionConfig

#: Relative RMS error bounds of a round trip, per format (ternary is TWN's
#: {-a, 0, +a}: about 0.4 on Gaussian data).
RMS_BOUND = {kvf.FP8: 0.04, kvf.NVFP4: 0.12, kvf.TERNARY: 0.5}
#: Relative error bounds of the attention output against bf16 K/V on
#: SmolLM2's own queries (measured 0.06, 0.26, 0.69: key errors dominate,
#: the softmax of a small model's keys being peaked).
ATTENTION_BOUND = {kvf.FP8: 0.08, kvf.NVFP4: 0.3, kvf.TERNARY: 0.8}


def round_trip(k, v, fmt, bits=8, valid=None):
    N, S, _ = k.shape
    valid = torch.ones(N, S, dtype=torch.bool) if valid is None else valid
    formats = torch.full((N,), fmt)
    q = kvf.quantize_pages(k, v, valid, formats, bits)
    return q, *kvf.dequantize_pages(q, formats, k.shape[-1])


def rel_rms(x, ref, mask):
    m = mask.unsqueeze(-1)
    return float(((x - ref) * m).pow(2).sum().sqrt() / (ref * m).pow(2).sum().sqrt())


@pytest.fixture(scope="module")
def smollm_kv():
    """Post-RoPE queries, keys and values of SmolLM2-135M-Instruct over a
    real prompt of 128 tokens: q [L, 128, Hq, D], k and v [L, Hkv, 128, D]."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    from kvsieve.service.default_model import ensure_default_model

    path = ensure_default_model()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    text = ("To find 17 times 23, split 23 into 20 and 3. 17 times 20 is 340 and 17 times 3 is 51, "
            "so the product is 340 plus 51, which is 391. Now check it another way: 23 times 17 ... ") * 3
    ids = tok(text, return_tensors="pt").input_ids[:, :128]
    queries, keys, values = [], [], []
    rope = modeling_llama.apply_rotary_pos_emb

    def recording(q, k, *args, **kwargs):
        q_embed, k_embed = rope(q, k, *args, **kwargs)
        queries.append(q_embed[0].transpose(0, 1))  # [T, Hq, D]
        keys.append(k_embed[0])  # [Hkv, T, D]
        return q_embed, k_embed

    def value_hook(module, args, out):
        values.append(out[0].view(out.shape[1], -1, 64).transpose(0, 1))  # [Hkv, T, D]

    hooks = [layer.self_attn.v_proj.register_forward_hook(value_hook) for layer in model.model.layers]
    modeling_llama.apply_rotary_pos_emb = recording
    try:
        with torch.no_grad():
            model(ids)
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()
    return torch.stack(queries), torch.stack(keys), torch.stack(values)


@pytest.mark.parametrize("fmt", [kvf.FP8, kvf.NVFP4, kvf.TERNARY])
def test_round_trip_on_random_kv_within_bounds(fmt):
    g = torch.Generator().manual_seed(fmt)
    k = torch.randn(32, 16, 64, generator=g) * 4 + torch.randn(1, 1, 64, generator=g) * 8  # outlier channels
    v = torch.randn(32, 16, 64, generator=g) * 0.05  # small values: the page scale keeps E4M3 in range
    valid = torch.rand(32, 16, generator=g) < 0.9
    _, kd, vd = round_trip(k, v, fmt, valid=valid)
    assert rel_rms(kd, k, valid) < RMS_BOUND[fmt]
    assert rel_rms(vd, v, valid) < RMS_BOUND[fmt]


def test_nvfp4_error_of_each_element_is_within_its_group_scale():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(8, 16, 64, generator=g) * 3, torch.randn(8, 16, 64, generator=g)
    q, kd, vd = round_trip(k, v, kvf.NVFP4, bits=4)
    kscale = (kvf.e4m3_decode(q.k_scale) * q.page_scale[:, :1]).unsqueeze(1)  # per channel
    vscale = (kvf.e4m3_decode(q.v_scale) * q.page_scale[:, 1:].unsqueeze(-1)).repeat_interleave(16, -1)
    # Half the largest E2M1 gap (2, between 4 and 6) in units of the group's scale.
    assert bool(((kd - k).abs() <= kscale * 1.0 + 1e-6).all())
    assert bool(((vd - v).abs() <= vscale * 1.0 + 1e-6).all())


def test_formats_encode_their_bits():
    q, _, _ = round_trip(torch.randn(1, 16, 64), torch.randn(1, 16, 64), kvf.TERNARY, bits=4)
    assert q.k_codes.shape[-1] == 32  # a 4-bit class row; ternary fills its first 16 bytes
    assert int(q.k_codes[..., 16:].count_nonzero()) == 0
    assert kvf.slot_bytes(kvf.NVFP4, 64, 2) == 64 + 4 and kvf.page_bytes(kvf.NVFP4, 64) == 72
    assert kvf.slot_bytes(kvf.FULL, 64, 2) == 256


@pytest.mark.parametrize("fmt", [kvf.FP8, kvf.NVFP4, kvf.TERNARY])
def test_round_trip_and_attention_on_real_kv(smollm_kv, fmt):
    q, k, v = smollm_kv
    L, H, T, D = k.shape
    pages = lambda x: x.reshape(-1, 16, D)  # noqa: E731  (pages of 16 tokens per (layer, head))
    valid = torch.ones(L * H * T // 16, 16, dtype=torch.bool)
    _, kd, vd = round_trip(pages(k), pages(v), fmt)
    assert rel_rms(kd, pages(k), valid) < RMS_BOUND[fmt]
    assert rel_rms(vd, pages(v), valid) < RMS_BOUND[fmt]
    # The model's own last 8 queries of every layer attend over the 128
    # tokens: quantized K/V against bf16 K/V.
    queries = q[:, -8:]  # [L, 8, Hq, D]: rows = layers
    mask = torch.ones(L, 8, H, T, dtype=torch.bool)
    empty = torch.zeros(L, 0, H, D)

    def attend(keys, values):
        return attention_ref.attend_rows(queries, empty, empty, torch.zeros(L, 0, dtype=torch.bool),
                                         keys.reshape(L, H, T, D), values.reshape(L, H, T, D), mask, D ** -0.5)[0]

    ref = attend(k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float())
    err = float((attend(kd, vd) - ref).norm() / ref.norm())
    assert err < ATTENTION_BOUND[fmt], err


def region(heads=2, quant_pages=8, bits=4, dtype=torch.float32):
    return PageManager(RegionConfig(num_layers=1, num_kv_heads=heads, head_dim=32, num_pages=4,
                                    quant_pages=quant_pages, quant_bits=bits, dtype=dtype))


def fill_group(pm, table, first_position, g, holes=()):
    buffer = table[:, :, 0]
    k = torch.randn(*buffer.shape, 16, 32, generator=g)
    v = torch.randn(*buffer.shape, 16, 32, generator=g)
    pm.k[buffer], pm.v[buffer] = k.to(pm.k.dtype), v.to(pm.v.dtype)
    pm.valid[buffer] = True
    for h, s in holes:
        pm.valid[buffer[0, h], s] = False
    pm.position[buffer] = first_position + torch.arange(16)
    return k, v


def test_groups_go_to_pages_of_their_format_and_read_back_at_it():
    pm = region()
    pm.allocate("a", 1, 3)
    pm.bind("a", 0)
    pm.flush()
    table = pm.table[0:1, 0]
    g = torch.Generator().manual_seed(0)
    k, _ = fill_group(pm, table, 0, g)
    assert not bool(tbq_store.flush(pm, table, torch.tensor([kvf.NVFP4]))[0])
    fill_group(pm, table, 16, g)
    assert not bool(tbq_store.flush(pm, table, torch.tensor([kvf.TERNARY]))[0])
    # Mixed precision in one request: one NVFP4 page, one ternary page per head; the full page is empty.
    assert pm.format[table[0]].tolist() == [[0, kvf.NVFP4, kvf.TERNARY, 0]] * 2
    assert pm.valid[table[0, :, 0]].sum() == 0
    assert pm.position[table[0, 0, 1]].tolist() == list(range(16))
    keys, _ = pm.kv_of(table)
    assert rel_rms(keys[0, :, 1], k[0], torch.ones(2, 16, dtype=torch.bool)) < RMS_BOUND[kvf.NVFP4]


def test_evicted_slots_are_refilled_by_their_format_and_empty_pages_retyped():
    pm = region()
    pm.allocate("a", 1, 3)
    pm.bind("a", 0)
    pm.flush()
    table = pm.table[0:1, 0]
    g = torch.Generator().manual_seed(1)
    for step, fmt in enumerate([kvf.NVFP4, kvf.TERNARY, kvf.NVFP4]):
        fill_group(pm, table, 16 * step, g)
        tbq_store.flush(pm, table, torch.tensor([fmt]))
    nv, tern, nv2 = table[0, 0, 1], table[0, 0, 2], table[0, 0, 3]
    before = pm.kv_of(table[:, :1, 1:2])[0][0, 0, 0, :8].clone()
    pm.valid[nv, 8:] = False  # eviction: 8 holes in the first NVFP4 page
    pm.valid[tern] = False  # the ternary page empties
    fill_group(pm, table, 100, g, holes=[(0, s) for s in range(8)])  # 8 NVFP4 tokens for head 0
    tbq_store.flush(pm, table, torch.tensor([kvf.NVFP4]))
    # Holes of the same format first: the first page takes the 8 new tokens.
    assert pm.position[nv].tolist() == list(range(8)) + list(range(108, 116))
    assert int(pm.format[nv]) == kvf.NVFP4 and int(pm.format[nv2]) == kvf.NVFP4
    # Its old tokens were requantized with the newcomers; still within the format's error.
    after = pm.kv_of(table[:, :1, 1:2])[0][0, 0, 0, :8]
    assert float((after - before).norm() / before.norm()) < RMS_BOUND[kvf.NVFP4]
    # The emptied ternary page keeps nothing, and takes the next group's format.
    fill_group(pm, table, 200, g)
    tbq_store.flush(pm, table, torch.tensor([kvf.NVFP4]))
    assert int(pm.format[tern]) == kvf.NVFP4 and int(pm.valid[tern].sum()) == 16
    # Pages freed and taken again start untyped.
    pm.free("a")
    pm.allocate("b", 1, 3)
    pm.bind("b", 1)
    pm.flush()
    assert int(pm.format[pm.table[1, 0, :, 1:]].abs().sum()) == 0
    assert int(pm.valid[pm.table[1, 0]].sum()) == 0


def test_a_group_without_room_is_flagged():
    pm = region(heads=1, quant_pages=1)
    pm.allocate("a", 1, 1)
    pm.bind("a", 0)
    pm.flush()
    table = pm.table[0:1, 0]
    g = torch.Generator().manual_seed(2)
    fill_group(pm, table, 0, g)
    assert not bool(tbq_store.flush(pm, table, torch.tensor([kvf.TERNARY]))[0])
    fill_group(pm, table, 16, g)
    assert bool(tbq_store.flush(pm, table, torch.tensor([kvf.TERNARY]))[0])
    assert int(pm.valid[table[0, 0, 0]].sum()) == 16  # nothing lost: the group stays where it was


def test_retained_bytes_count_codes_and_scales_exactly():
    pm = region(heads=2, dtype=torch.bfloat16)
    pm.allocate("a", 1, 3)
    pm.bind("a", 0)
    pm.flush()
    table = pm.table[0:1, 0]
    g = torch.Generator().manual_seed(4)
    fill_group(pm, table, 0, g)
    tbq_store.flush(pm, table, torch.tensor([kvf.NVFP4]))
    fill_group(pm, table, 16, g)
    tbq_store.flush(pm, table, torch.tensor([kvf.TERNARY]))
    fill_group(pm, table, 32, g, holes=[(0, s) for s in range(10)] + [(1, s) for s in range(10)])  # 6 full each
    pm.valid[table[0, :, 1], :4] = False  # 12 NVFP4 slots left per head
    D = 32
    per_head = 12 * (2 * D // 2 + D // 16) + (8 + D) + 16 * (2 * D // 4 + D // 16) + (8 + D) + 6 * 2 * D * 2
    assert int(pm.retained_bytes_of_rows(torch.tensor([0]))[0]) == 2 * per_head


def test_a_flush_in_passes_of_rows_equals_one_pass(monkeypatch):
    # Rows admitted together fill their groups in the same step; the flush
    # takes them FLUSH_ROWS at a time to bound its temporaries.
    def run(passes_of):
        monkeypatch.setattr(tbq_store, "FLUSH_ROWS", passes_of)
        pm = PageManager(RegionConfig(num_layers=1, num_kv_heads=2, head_dim=32, num_pages=8, quant_pages=24,
                                      quant_bits=4, max_rows=3, dtype=torch.float32))
        for row, rid in enumerate("abc"):
            pm.allocate(rid, 1, 3)
            pm.bind(rid, row)
        pm.flush()
        table = pm.table[0:3, 0]
        g = torch.Generator().manual_seed(2)
        overflow = [tbq_store.flush(pm, table, torch.tensor([kvf.NVFP4, kvf.TERNARY, kvf.NVFP4]))
                    for _ in range(2) if fill_group(pm, table, 0, g) is not None]
        return pm.kv_of(table), pm.format[table].clone(), pm.valid[table].clone(), torch.stack(overflow)

    (k1, v1), f1, valid1, o1 = run(passes_of=128)
    (k2, v2), f2, valid2, o2 = run(passes_of=1)
    assert torch.equal(f1, f2) and torch.equal(valid1, valid2) and torch.equal(o1, o2)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert {kvf.NVFP4, kvf.TERNARY} <= set(f1[:, :, 1:].unique().tolist())  # both formats were written


@pytest.mark.parametrize("pages_per_pass", [2048, 3])
def test_the_flush_equals_its_per_token_reference_on_fragmented_pages(pages_per_pass, monkeypatch):
    # Groups of 2 layers x 2 heads x 5 rows in mixed formats, buffers with
    # holes, and evictions from the quantized pages between flushes, so that
    # groups split over pages of several kinds; every array the flush writes
    # must be equal, bit for bit, to the per-token formulation's.
    from helpers.tbq_reference import flush_rows_per_token

    def run(flush):
        pm = PageManager(RegionConfig(num_layers=2, num_kv_heads=2, head_dim=32, num_pages=20, quant_pages=80,
                                      quant_bits=8, max_rows=5, dtype=torch.float32))
        for row in range(5):
            pm.allocate(f"r{row}", 1, 4)
            pm.bind(f"r{row}", row)
        pm.flush()
        table = pm.table[:5].flatten(0, 1)  # every layer's rows stacked, as the backend flushes them
        g = torch.Generator().manual_seed(7)
        overflow = []
        for step in range(6):
            fill_group(pm, table, 16 * step, g)
            pm.valid[table[:, :, 0]] &= torch.rand(*table.shape[:2], 16, generator=g) < 0.8  # holes
            fmt = torch.randint(1, 4, (table.shape[0],), generator=g)  # ternary, NVFP4, FP8
            overflow.append(flush(pm, table, fmt))
            quantized = table[:, :, 1:]
            pm.valid[quantized] &= torch.rand(*quantized.shape, 16, generator=g) < 0.7  # evictions
        keep = torch.arange(pm.valid.shape[0]) != pm.null_page
        q = pm.quant
        return ([torch.stack(overflow), pm.valid[keep], pm.position[keep], pm.format[keep], pm.vnorm[keep]]
                + [t[:q.null] for t in (q.k_codes, q.v_codes, q.k_scale, q.v_scale, q.page_scale)])

    monkeypatch.setattr(tbq_store, "FLUSH_PAGES", pages_per_pass)  # destination pages requantized per pass
    fast, reference = run(tbq_store.flush_rows), run(flush_rows_per_token)
    for a, b in zip(fast, reference):
        assert torch.equal(a, b)
    held = fast[1][-80:].sum(-1)  # the quantized pages' valid slots
    assert ((held > 0) & (held < 16)).sum() >= 10  # groups went into pages with holes
