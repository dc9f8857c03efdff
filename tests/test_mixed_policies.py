"""Every served policy in one batch: each request's greedy output equals its
run in a batch of the same prompts all under its own policy, so mixing
policies changes no row's tokens.
A real `kvsieve serve` (the session's tiny Llama on CPU); the policy list
comes from the registry, so a newly registered policy is covered here too.

The reference is a batch of the same size, not a run alone: on CPUs whose
GEMMs pick their kernels by the number of rows (AVX-512 Xeons), a row of
ten and the same row alone round differently and a near-tie can flip
(LongFlow's row here from token 28), whatever the policies; on the GPU the
same holds (docs/gpu-kernels.md, the 320-row equality: the row count
changes tokens, mixing does not)."""

from kvsieve.policies import get_policy, policy_names
from test_compressed import complete_together, region_idle

GEN = 40
#: A budget that makes each policy evict within GEN tokens, where the
#: default (8) is not one it accepts.
BUDGETS = {"crystalcache": 136}


def policy_for(name: str):
    if not get_policy(name).compresses:
        return name
    return {"name": name, "budget": BUDGETS.get(name, 8)}


def prompt_for(index: int) -> list[int]:
    # First ids counted down from the top of the tiny vocabulary (410): no
    # other test starts a prompt there, so no radix hit changes the run.
    return [409 - index, 33, 71, 5, 260, 18, 99, 140, 7, 301, 45, 62]


def test_every_policy_in_one_batch_equals_its_run_beside_its_own_kind(llama_server):
    names = policy_names()
    assert len(names) >= 9  # full, the four baselines, rkv and the seed policies
    prompts = [prompt_for(i) for i in range(len(names))]
    own = {}
    for i, name in enumerate(names):
        # Every prompt under this one policy; row i is the mixed batch's row of `name`.
        out = complete_together(llama_server, [(prompt, policy_for(name)) for prompt in prompts], max_tokens=GEN)[i]
        own[name] = out["choices"][0]["token_ids"]
        assert len(own[name]) == GEN

    mixed = dict(zip(names, complete_together(
        llama_server, [(prompts[i], policy_for(name)) for i, name in enumerate(names)], max_tokens=GEN)))
    for name in names:
        assert mixed[name]["choices"][0]["token_ids"] == own[name], name
        assert mixed[name]["kv_usage"]["policy"] == name
    # Something was evicted in the batch (the budgets are below the length).
    assert any(mixed[n]["kv_usage"]["evicted_tokens"] > 0 for n in names if get_policy(n).compresses)
    assert region_idle(llama_server)
