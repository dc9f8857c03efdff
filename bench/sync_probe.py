"""Host syncs and time of the batched compressed pass, layer by layer, outside
SGLang: the real page manager, step builder and backend methods on CUDA
tensors, with torch.cuda's sync debug mode recording every synchronizing
call and where it came from. Runs on the GPU host (device tool):

    python bench/sync_probe.py OUT.json [--rows 64] [--prompt 128] [--steps 32]

On CPU it runs the same code (no syncs exist there): a smoke check.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from types import SimpleNamespace

import torch

from kvsieve.radix_ext.backend import KvsieveAttnBackend
from kvsieve.radix_ext.pages import PageManager, RegionConfig
from kvsieve.radix_ext.runtime import RUNTIME
from kvsieve.radix_ext.step_meta import StepBuilder

# R1-Distill-Qwen-7B attention shapes.
LAYERS, HQ, H, D = 28, 28, 4, 128


class Mode:
    def __init__(self, decode):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode

    def is_idle(self):
        return False


class Pool:
    """SGLang's token pool as the backend reads it: K/V buffers per layer."""

    def __init__(self, tokens, device):
        self.k = [torch.randn(tokens, H, D, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]
        self.v = [torch.randn(tokens, H, D, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


def make_backend(policy: str, rows: int, prompt: int, steps: int, device: str, graphs=None, budget: int = 64):
    """The kvsieve backend outside SGLang, with `rows` compressed requests of
    `policy` whose prompts sit in the token pool, and the fake batch of
    step s (0-based)."""
    RUNTIME.requests.clear()
    RUNTIME.region = PageManager(RegionConfig(num_layers=LAYERS, num_kv_heads=H, head_dim=D, num_pages=rows * 40 * LAYERS * H // 4,
                                              page_size=16, dtype=torch.bfloat16, device=device, max_rows=rows + 1))
    RUNTIME.counters = torch.zeros((rows + 1, 2), dtype=torch.int64, device=device)
    RUNTIME.overflow_flags = torch.zeros(rows + 1, dtype=torch.bool, device=device)
    req_to_token = torch.arange((rows + 1) * (prompt + steps + 1), dtype=torch.int32, device=device).view(rows + 1, -1)
    backend = object.__new__(KvsieveAttnBackend)
    backend.__dict__.update(inner=SimpleNamespace(), token_to_kv_pool=Pool(req_to_token.numel(), device),
                            num_layers=LAYERS, device=device, pages=RUNTIME.region, step=None,
                            use_kernel=os.environ.get("KVSIEVE_DECODE_KERNEL",
                                                      "triton" if device == "cuda" else "torch") == "triton",
                            steps=StepBuilder(RUNTIME.region, req_to_token, device), graphs=graphs)
    rids = [f"r{i}" for i in range(rows)]
    for i, rid in enumerate(rids):
        RUNTIME.admit(rid, {"kv_policy": {"name": policy, "budget": budget, "compress_prompt": False}}, prompt_len=prompt,
                      sgl_req=SimpleNamespace(req_pool_idx=i + 1, to_finish=None))
        req = RUNTIME.requests[rid]
        RUNTIME.reserve(req, 0, steps + 1)
        req.prefix_len = prompt  # the prompt is in the token pool (compress_prompt off)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, tp_k_head_num=H, qk_head_dim=D, v_head_dim=D,
                            scaling=D ** -0.5)

    def batch(s):
        seq = [prompt + s + 1] * rows
        return SimpleNamespace(rids=rids, forward_mode=Mode(decode=True), seq_lens_cpu=torch.tensor(seq),
                               seq_lens=torch.tensor(seq, device=device),
                               req_pool_indices=torch.arange(1, rows + 1, device=device),
                               positions=torch.tensor(seq, device=device) - 1)

    return backend, layer, rids, batch


def probe(policy: str, rows: int, prompt: int, steps: int, device: str) -> dict:
    backend, layer, rids, batch = make_backend(policy, rows, prompt, steps, device)
    syncs: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            here = [f for f in traceback.extract_stack()[:-1] if "kvsieve" in f.filename]
            where = f"{here[-1].filename.rsplit('/', 1)[-1]}:{here[-1].lineno} {here[-1].line}" if here else "?"
            syncs[where] = syncs.get(where, 0) + 1

    times = []
    q3 = torch.randn(rows, HQ, D, dtype=torch.bfloat16, device=device)
    k3 = torch.randn(rows, H, D, dtype=torch.bfloat16, device=device)
    v3 = torch.randn(rows, H, D, dtype=torch.bfloat16, device=device)
    for s in range(steps):
        fb = batch(s)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                step = backend.steps.build(fb)
                o3 = torch.empty_like(q3)
                for layer_id in range(LAYERS):
                    layer.layer_id = layer_id
                    backend._decode_region(q3, k3, v3, o3, layer, step)
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    held = RUNTIME.region.held_tokens(rids[:1])[0] // (LAYERS * H)
    RUNTIME.requests.clear()
    RUNTIME.region = None
    times = sorted(times[2:])
    return {"policy": policy, "rows": rows, "steps": steps, "host_syncs_per_step": sum(syncs.values()) / steps,
            "sync_sites": syncs, "median_step_ms": round(1000 * times[len(times) // 2], 2),
            "retained_tokens_row0": held}


def main() -> None:
    out = sys.argv[1]
    args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
    rows, prompt, steps = int(args.get("--rows", 64)), int(args.get("--prompt", 128)), int(args.get("--steps", 32))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               "date": time.strftime("%Y-%m-%d"), "command": "python bench/sync_probe.py " + " ".join(sys.argv[1:]),
               "decode_kernel": os.environ.get("KVSIEVE_DECODE_KERNEL", "triton" if device == "cuda" else "torch"),
               "shapes": {"layers": LAYERS, "q_heads": HQ, "kv_heads": H, "head_dim": D},
               "probes": [probe(p, rows, prompt, steps, device) for p in ("streaming", "h2o", "snapkv", "longflow")]}
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
