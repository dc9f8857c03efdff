"""Token observation (radix_ext/runtime.observe_tokens) on a forward SGLang
replayed from its own CUDA graphs: the prefill graphs' static batch names no
requests (rids None). On an H100 such a forward of `full` prompts beside a
live skipkv request raised TypeError in the logits processor's hook and took
the scheduler down (bench/traffic.py, 2026-11-27)."""

from types import SimpleNamespace

import torch

from kvsieve.radix_ext.runtime import RUNTIME

from test_step_meta import admit, runtime  # noqa: F401  (fixture)


class _Extend:
    def is_extend(self):
        return True


def test_a_forward_that_names_no_requests_is_not_observed(runtime):
    req = admit("watched", {"name": "skipkv", "budget": 16}, prompt_len=5, row=3)
    assert req.rid in RUNTIME.token_observers  # skipkv watches its sentences' tokens
    seen = []
    req.policy.on_forward_tokens = lambda requests, *rest: seen.append(requests)
    batch = SimpleNamespace(rids=None, forward_mode=_Extend(), extend_seq_lens_cpu=[3],
                            positions=torch.arange(3))
    RUNTIME.observe_tokens(batch, torch.tensor([1, 2, 3]), torch.zeros(3, 4))
    assert seen == [] and not req.overflowed
    # The same forward naming the request is observed.
    batch.rids = ["watched"]
    RUNTIME.observe_tokens(batch, torch.tensor([1, 2, 3]), torch.zeros(3, 4))
    assert len(seen) == 1 and seen[0][0][2] == 3
