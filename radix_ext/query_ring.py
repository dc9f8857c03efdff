"""Need.QUERIES: the latest decode queries of every req_pool row, per layer.

R-KV recomputes the attention of its last `window` queries over the held
keys when it compresses (policies/skipkv/rkv_paper.py). The attention pass
writes each compressed row's query of the step into slot position %
QUERY_WINDOW of its ring (backend.decode_attend), and a deciding group of a
policy that needs them reads its rows' rings (backend._call_policy, as
SlotView.queries). Both are tensor ops on buffers made once, so they replay
inside captured graphs (radix_ext/region_graphs.py): the write belongs to
the attention segment, the read to the group's.

Memory: rows x layers x QUERY_WINDOW x q_heads x head_dim elements of the
model's dtype (R1-Distill-Qwen-7B, bf16: 28 x 8 x 28 x 128 x 2 B = 1.5 MiB
per req_pool row, 1.5 GiB for 1024 rows), plus an int64 position per slot.
Made at the first step that needs it, for every req_pool row (a row's
place in it is its req_pool row): only a server that runs R-KV's paper
scoring pays it.
"""

from __future__ import annotations

import torch

from kvsieve.policies.observations import QUERY_WINDOW


class QueryRing:
    def __init__(self, rows: int, layers: int, q_heads: int, head_dim: int, dtype: torch.dtype, device):
        self.queries = torch.zeros((rows, layers, QUERY_WINDOW, q_heads, head_dim), dtype=dtype, device=device)
        self.position = torch.full((rows, layers, QUERY_WINDOW), -1, dtype=torch.int64, device=device)

    @classmethod
    def for_queries(cls, rows: int, layers: int, q: torch.Tensor) -> "QueryRing":
        """A ring shaped for this layer's queries q [R, Hq, D] (this rank's heads)."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            # Made from a captured pass it would live in the graph's pool; the
            # capture fails instead and that pass runs eagerly (region_graphs).
            raise RuntimeError("the query ring must be made outside a CUDA-graph capture")
        return cls(rows, layers, q.shape[1], q.shape[2], q.dtype, q.device)

    def keep(self, layer: int, pool_rows: torch.Tensor, positions: torch.Tensor, q: torch.Tensor) -> None:
        """Store each row's query q [R, Hq, D] of the token at `positions` [R]."""
        slot = positions % QUERY_WINDOW
        self.queries[pool_rows, layer, slot] = q.to(self.queries.dtype)
        self.position[pool_rows, layer, slot] = positions

    def recent(self, layer: int, pool_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' ring in `layer`: queries [R, W, Hq, D] and positions [R, W]."""
        return self.queries[pool_rows, layer], self.position[pool_rows, layer]
