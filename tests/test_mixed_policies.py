"""Every served policy in one batch: each request's greedy output equals its
solo run.
A real `kvsieve serve` (the session's tiny Llama on CPU); the policy list
comes from the registry, so a newly registered policy is covered here too."""

from kvsieve.policies import get_policy, policy_names
from test_compressed import complete, complete_together, region_idle

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


def test_every_policy_in_one_batch_equals_its_solo_run(llama_server):
    names = policy_names()
    assert len(names) >= 9  # full, the four baselines, rkv and the seed policies
    solo = {}
    for i, name in enumerate(names):
        out = complete(llama_server, prompt_for(i), policy_for(name), max_tokens=GEN)
        solo[name] = out["choices"][0]["token_ids"]
        assert len(solo[name]) == GEN

    mixed = dict(zip(names, complete_together(
        llama_server, [(prompt_for(i), policy_for(name)) for i, name in enumerate(names)], max_tokens=GEN)))
    for name in names:
        assert mixed[name]["choices"][0]["token_ids"] == solo[name], name
        assert mixed[name]["kv_usage"]["policy"] == name
    # Something was evicted in the batch (the budgets are below the length).
    assert any(mixed[n]["kv_usage"]["evicted_tokens"] > 0 for n in names if get_policy(n).compresses)
    assert region_idle(llama_server)
