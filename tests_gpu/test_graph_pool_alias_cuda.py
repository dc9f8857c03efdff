"""Why the replayed decoder stack's output is copied before the groups'
graphs replay (forward_graphs.ForwardGraphs._stack).

Every graph of the region graphs is recorded into one memory pool
(RegionGraphs.capture). A tensor a later capture keeps (the stack's hidden
states) can be given the blocks that an earlier capture (a policy group's
pass) used for its temporaries and freed: PyTorch's allocator reuses a freed
block for an allocation on the same stream, and each capture takes the next
of its 32 pooled streams. The earlier graph's replay then writes its
temporaries over the kept tensor. This records a "group" pass, then `gap`
empty captures, then a "stack" pass that keeps its output, for gaps of 0 to
40, through RegionGraphs.capture itself; it expects the kept output to share
the group's freed block, and be overwritten by the group's replay, for some
gap, and to survive when copied right after the stack's replay (the fix).
If a PyTorch upgrade stops the reuse, this fails, and the copy can go.
"""

from __future__ import annotations

import torch

from kvsieve.radix_ext.region_graphs import RegionGraphs

N = 1 << 20  # floats: one block of the pool, the same size in both passes


def _record(gap: int) -> dict:
    region = RegionGraphs()
    x = torch.arange(N, device="cuda", dtype=torch.float32)
    group_out = torch.empty_like(x)
    seen: dict = {}

    def group_pass():
        scratch = x * 2  # a temporary of the group's pass, freed when the pass ends
        seen["scratch"] = scratch.data_ptr()
        group_out.copy_(scratch)

    def stack_pass():
        seen["hidden"] = x + 3  # kept after the capture, like the stack's hidden states

    group = region.capture(group_pass)
    for _ in range(gap):
        region.capture(lambda: group_out.add_(0))  # allocates nothing; moves to the next pooled stream
    stack = region.capture(stack_pass)
    stack.replay()
    copied = seen["hidden"].clone()  # what ForwardGraphs returns
    group.replay()
    torch.cuda.synchronize()
    expected = x + 3
    return {"gap": gap, "aliased": seen["hidden"].data_ptr() == seen["scratch"],
            "overwritten": not torch.equal(seen["hidden"], expected), "copy_intact": torch.equal(copied, expected)}


def test_a_later_captures_kept_output_can_take_an_earlier_captures_temporaries():
    results = [_record(gap) for gap in range(41)]
    aliased = [r["gap"] for r in results if r["aliased"]]
    print("gaps whose stack output took the group's freed block:", aliased)
    assert aliased, "no capture reused an earlier capture's freed block: the copy in ForwardGraphs._stack is not needed"
    for r in results:
        assert r["overwritten"] == r["aliased"], r  # aliasing is exactly when the group's replay clobbers it
        assert r["copy_intact"], r
