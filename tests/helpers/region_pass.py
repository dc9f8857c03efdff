"""The compressed decode pass outside SGLang: the real page manager, step
builder and backend methods over a fake token pool and fake decode batches.
tests/test_region_pass.py runs it on CPU in every CI run; on a GPU,
tests_gpu/test_region_pass_cuda.py checks CUDA-graph replay and host syncs
of the per-layer pass with it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kvsieve.kernels import region_store, slot_view
from kvsieve.radix_ext.backend import KvsieveAttnBackend
from kvsieve.radix_ext.pages import PageManager, RegionConfig
from kvsieve.radix_ext.runtime import RUNTIME
from kvsieve.radix_ext.step_meta import StepBuilder


@dataclass(frozen=True)
class Shapes:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int


#: R1-Distill-Qwen-7B's attention, the headline's model.
QWEN_7B = Shapes(layers=28, q_heads=28, kv_heads=4, head_dim=128)
TINY = Shapes(layers=2, q_heads=4, kv_heads=2, head_dim=16)


class _Mode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode

    def is_idle(self):
        return False


class _Pool:
    """SGLang's token pool as the backend reads it: K/V buffers per layer."""

    def __init__(self, tokens: int, shapes: Shapes, dtype, device):
        size = (tokens, shapes.kv_heads, shapes.head_dim)
        self.k = [torch.randn(size, dtype=dtype, device=device) for _ in range(shapes.layers)]
        self.v = [torch.randn(size, dtype=dtype, device=device) for _ in range(shapes.layers)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


@dataclass
class RegionPass:
    """`rows` compressed requests of one policy whose prompts sit in the
    token pool, decoding; `step(s, q, k, v)` runs decode step s (0-based)
    through every layer and returns the outputs [layers, rows, q_heads, dim]."""

    backend: KvsieveAttnBackend
    layers: list
    rids: list[str]
    shapes: Shapes
    prompt: int
    device: str
    token_ids: bool = False  # hand the policy each step's token ids (Need.TOKEN_IDS)
    last_step: object = None  # the StepMeta of the last run_batch

    def batch(self, s: int) -> SimpleNamespace:
        seq = [self.prompt + s + 1] * len(self.rids)
        return SimpleNamespace(rids=self.rids, forward_mode=_Mode(decode=True), seq_lens_cpu=torch.tensor(seq),
                               seq_lens=torch.tensor(seq, device=self.device),
                               req_pool_indices=torch.arange(1, len(self.rids) + 1, device=self.device),
                               positions=torch.tensor(seq, device=self.device) - 1,
                               out_cache_loc=torch.zeros(len(self.rids), dtype=torch.int64, device=self.device))

    def step(self, s: int, q3, k3, v3) -> torch.Tensor:
        return self.run_batch(self.batch(s), q3, k3, v3)

    def run_batch(self, forward_batch, q3, k3, v3) -> torch.Tensor:
        """One step of a batch made by batch(s): metadata once, then every layer."""
        backend = self.backend
        step = self.last_step = backend.step = backend.steps.build(forward_batch)
        if backend.graphs is not None:
            backend.graphs.begin_step(step, needs_keys=False)
        outputs = []
        for layer_id in range(self.shapes.layers):
            layer = self.layers[layer_id]  # one object per layer, as SGLang's attention modules
            o3 = torch.empty_like(q3)
            if backend.graphs is None or not backend.graphs.run(backend, layer, q3, k3, v3, o3):
                backend._decode_region(q3, k3, v3, o3, layer, step)
            outputs.append(o3)
        if backend.graphs is not None and backend.graphs.deferred():
            backend.after_stack(replayed=False)  # the groups' passes over every layer (forward_graphs' hook)
        if self.token_ids:  # one id per row after the step: its position mod 50
            RUNTIME.observe_tokens(forward_batch, forward_batch.positions % 50, None)
        return torch.stack(outputs)

    def region_state(self) -> tuple:
        p = RUNTIME.region
        return p.valid.clone(), p.position.clone(), p.score.clone(), RUNTIME.counters.clone()

    def held_tokens_per_head(self) -> list[int]:
        per_head = self.shapes.layers * self.shapes.kv_heads
        return [n // per_head for n in RUNTIME.region.held_tokens(self.rids)]

    def close(self) -> None:
        RUNTIME.requests.clear()
        RUNTIME.token_observers.clear()
        RUNTIME.region = None


def region_pass(policy: str, rows: int, prompt: int, steps: int, *, shapes: Shapes = QWEN_7B, budget: int = 16,
                device: str = "cuda", dtype=torch.bfloat16, graphs=None, params: dict | None = None,
                token_ids: bool = False) -> RegionPass:
    """The kvsieve backend outside SGLang (RUNTIME set up afresh: call
    close() after). Seed torch first where two runs must see the same pool.
    `policy` "a+b+c": a mixed batch, the rows dealt to the policies in turn."""
    L, H = shapes.layers, shapes.kv_heads
    RUNTIME.requests.clear()
    RUNTIME.region = PageManager(RegionConfig(num_layers=L, num_kv_heads=H, head_dim=shapes.head_dim,
                                              num_pages=rows * 40 * L * H // 4, page_size=16, dtype=dtype,
                                              device=device, max_rows=rows + 1))
    RUNTIME.counters = torch.zeros((rows + 1, 2), dtype=torch.int64, device=device)
    RUNTIME.overflow_flags = torch.zeros(rows + 1, dtype=torch.bool, device=device)
    req_to_token = torch.arange((rows + 1) * (prompt + steps + 1), dtype=torch.int32,
                                device=device).view(rows + 1, -1)
    backend = object.__new__(KvsieveAttnBackend)
    kernel = os.environ.get("KVSIEVE_DECODE_KERNEL", "triton" if device == "cuda" else "torch")
    backend.__dict__.update(inner=SimpleNamespace(), token_to_kv_pool=_Pool(req_to_token.numel(), shapes, dtype, device),
                            num_layers=L, device=device, pages=RUNTIME.region, step=None,
                            use_kernel=kernel == "triton", fused_store=kernel == "triton" and region_store.enabled(),
                            fused_view=kernel == "triton" and slot_view.enabled(),
                            steps=StepBuilder(RUNTIME.region, req_to_token, device),
                            graphs=graphs, step_log=None)
    if graphs is not None:
        graphs.observations.num_layers = L  # as the backend sets it: one buffer a kind for every layer
    rids = [f"r{i}" for i in range(rows)]
    for i, rid in enumerate(rids):
        name = policy.split("+")[i % len(policy.split("+"))]
        RUNTIME.admit(rid, {"kv_policy": {"name": name, "budget": budget, "compress_prompt": False,
                                          "params": params or {}}},
                      prompt_len=prompt, sgl_req=SimpleNamespace(req_pool_idx=i + 1, to_finish=None))
        req = RUNTIME.requests[rid]
        RUNTIME.reserve(req, 0, steps + 1)
        req.prefix_len = prompt  # the prompt is in the token pool (compress_prompt off)
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=shapes.q_heads, tp_k_head_num=H, qk_head_dim=shapes.head_dim,
                              v_head_dim=shapes.head_dim, scaling=shapes.head_dim ** -0.5) for i in range(L)]
    return RegionPass(backend=backend, layers=layers, rids=rids, shapes=shapes, prompt=prompt, device=device,
                      token_ids=token_ids)


def random_qkv(rows: int, shapes: Shapes, generator: torch.Generator, device: str, dtype=torch.bfloat16):
    """One decode step's q, k, v for every row."""
    def draw(heads):
        return torch.randn(rows, heads, shapes.head_dim, dtype=dtype, device=device, generator=generator)
    return draw(shapes.q_heads), draw(shapes.kv_heads), draw(shapes.kv_heads)


def run_steps(policy: str, rows: int, prompt: int, steps: int, *, shapes: Shapes, budget: int, device: str,
              dtype=torch.bfloat16, graphs=None, params: dict | None = None, token_ids: bool = False,
              pass_slots: int | None = None) -> dict:
    """Decode steps 0..steps-1 of `rows` requests on random q/k/v (seeded:
    two calls see the same pool and inputs): every step's outputs, the
    region's final state, (captures, replays) when graphs ran, and the
    policy calls made. `pass_slots`: the plan's bound on a group pass
    (KvsieveAttnBackend.pass_slots; None: unplanned)."""
    torch.manual_seed(0)  # the token pool's random prefix K/V
    run = region_pass(policy, rows, prompt, steps, shapes=shapes, budget=budget, device=device, dtype=dtype,
                      graphs=graphs, params=params, token_ids=token_ids)
    run.backend.pass_slots = pass_slots
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        outputs = torch.stack([run.step(s, *random_qkv(rows, shapes, gen, device, dtype)) for s in range(steps)])
        if device == "cuda":
            torch.cuda.synchronize()
        stats = (graphs.captures, graphs.replays) if graphs is not None else (0, 0)
        return {"outputs": outputs, "state": run.region_state(), "captures_replays": stats,
                "policy_calls": run.backend.policy_calls}
    finally:
        run.close()


def redundant_sentences(prompt: int):
    """A stand-in for skipkv's step_inputs: no forward runs in this harness,
    so no sentence ever ends and skipkv's spans stay empty; this hands every
    row four redundant sentences over its generated positions (from prompt +
    2 to prompt + 25), in a different eviction order per row, so that the
    pass drops whole sentences."""
    from kvsieve.policies.observations import to_device

    def step_inputs(self, rows, device):
        R = len(rows)
        starts = torch.tensor([[prompt + 2, prompt + 8, prompt + 14, prompt + 22]] * R)
        ends = starts + torch.tensor([4, 5, 7, 3])
        penalty = torch.tensor([[0.95, 0.93, 0.97, 0.91]] * R)
        rank = torch.tensor([[(i + r) % 4 for i in range(4)] for r in range(R)])
        return {"span_starts": to_device(starts, torch.int64, device),
                "span_ends": to_device(ends, torch.int64, device),
                "span_penalty": to_device(penalty, torch.float32, device),
                "span_rank": to_device(rank, torch.int64, device)}

    return step_inputs


def joining_steps(policy: str, starts: list[int], ends: list[int], steps: int, *, prompt: int, shapes: Shapes,
                  budget: int, device: str, dtype, graphs, pad: bool) -> dict:
    """Decode steps 0..steps-1 of len(starts) rows, row i decoding in steps
    [starts[i], ends[i]) at its own step s - starts[i] (requests joining
    and ending), on random q/k/v (seeded: two calls see the same), policy
    groups padded to row buckets (StepBuilder.pad_groups) or not. Returns every
    step's outputs of its rows, the region's final state without the null
    page and SGLang's padding row (which padded rows write), the padded
    rows per step, and the graph replays."""
    from kvsieve.radix_ext.step_meta import PAD_POOL_ROW

    rows = len(starts)
    torch.manual_seed(0)
    run = region_pass(policy, rows, prompt, steps + 1, shapes=shapes, budget=budget, device=device, dtype=dtype,
                      graphs=graphs)
    run.backend.steps.pad_rows = pad
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        outputs, padded = [], []
        for s in range(steps):
            active = [i for i in range(rows) if starts[i] <= s < ends[i]]
            seq = torch.tensor([prompt + s - starts[i] + 1 for i in active])
            batch = SimpleNamespace(rids=[run.rids[i] for i in active], forward_mode=_Mode(decode=True),
                                    seq_lens_cpu=seq, seq_lens=seq.to(device),
                                    req_pool_indices=torch.tensor([i + 1 for i in active], device=device),
                                    positions=(seq - 1).to(device),
                                    out_cache_loc=torch.zeros(len(active), dtype=torch.int64, device=device))
            index = torch.tensor(active, device=device)
            q, k, v = random_qkv(rows, shapes, gen, device, dtype)  # every row's, so both runs see the same
            outputs.append(run.run_batch(batch, q[index], k[index], v[index]))
            region = run.last_step.region
            padded.append(region.pool_rows.shape[0] - region.real)
            assert (region.pool_rows[region.real:] == PAD_POOL_ROW).all()
        if device == "cuda":
            torch.cuda.synchronize()
        valid, position, score, counters = run.region_state()
        null = run.backend.pages.null_page
        assert not valid[null].any()  # padded rows never store a valid slot in the null page
        keep = torch.arange(valid.shape[0], device=valid.device) != null
        return {"outputs": outputs, "state": (valid[keep], position[keep], score[keep], counters[1:]),
                "padded": padded,
                "replays": graphs.replays + graphs.group_replays if graphs is not None else 0}  # every segment
    finally:
        run.close()
