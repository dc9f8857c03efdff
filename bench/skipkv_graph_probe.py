"""skipkv's decision with redundant sentences, CUDA-graph replay against the
eager pass (bench/graph_probe.py's harness, GPU only):

    python bench/skipkv_graph_probe.py OUT.json [--rows 64] [--steps 48]

graph_probe runs no forward, so no sentence ever ends there and skipkv's
spans stay empty (K = 0). Here step_inputs hands every row four redundant
sentences over the generated positions (prompt 128: positions 130-153),
with a different eviction order per row, so the replayed pass runs the
whole-sentence drops too.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import graph_probe  # noqa: E402

from kvsieve.policies import get_policy, policy_names  # noqa: E402
from kvsieve.policies.observations import to_device  # noqa: E402
from kvsieve.policies.skipkv import SkipKVPolicy  # noqa: E402


def spans_for_every_row(self, rows, device):
    R = len(rows)
    starts = torch.tensor([[130, 136, 142, 150]] * R)
    ends = starts + torch.tensor([4, 5, 7, 3])
    penalty = torch.tensor([[0.95, 0.93, 0.97, 0.91]] * R)
    rank = torch.tensor([[(i + r) % 4 for i in range(4)] for r in range(R)])
    return {"span_starts": to_device(starts, torch.int64, device), "span_ends": to_device(ends, torch.int64, device),
            "span_penalty": to_device(penalty, torch.float32, device),
            "span_rank": to_device(rank, torch.int64, device)}


if __name__ == "__main__":
    SkipKVPolicy.step_inputs = spans_for_every_row
    for name in policy_names():
        get_policy(name).graph_safe = name == "skipkv"
    graph_probe.main()
