"""A fault inside one request's policy ends that policy's requests with an
error and nothing else (radix_ext/faults.py): the scheduler keeps running,
the other requests of the batch produce the tokens they produce alone, every
region page comes back, and the fault is counted. The failing policy is
tests/policies_extra/faulty_policy.py (H2O that raises where its params say),
served with --policy-module beside the built-in ones."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import EXTRA_POLICIES, start_server
from kvsieve.service.sse_client import asse_lines
from test_compressed import complete, metric, region_idle

GEN = 20
OTHERS = [{"name": "streaming", "budget": 8}, {"name": "h2o", "budget": 8}, {"name": "rkv", "budget": 8},
          {"name": "rkv", "budget": 8, "params": {"buffer": 1}}, {"name": "skipkv", "budget": 8},
          {"name": "snapkv", "budget": 8}, {"name": "crystalcache", "budget": 160}, "full"]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    # Decision scratch of a few KiB: every group that reads keys (rkv,
    # skipkv, crystalcache) decides one row at a time in a batch, so the
    # batch-equals-solo check below covers the chunked decisions too.
    s = start_server(tmp_path_factory.mktemp("faults"), "--model", str(tiny_llama),
                     "--policy-module", "faulty_policy",
                     env={"PYTHONPATH": str(EXTRA_POLICIES), "KVSIEVE_DECISION_SCRATCH_MB": "0.004"})
    yield s
    assert s.stop() == 0, s.log()


def prompt(i: int) -> list[int]:
    # Ids below the tiny model's vocabulary (410); the first differs per i (no prefix hit).
    return [100 + 5 * i, 17, 230 + i, 44, 150, 23 + i, 9, 81, 200, 5, 61 + i, 17, 33, 302 - i, 12, 8]


def faulty(compress_prompt=False, **params):
    return {"name": "test_faulty", "budget": 8, "compress_prompt": compress_prompt, "params": params}


async def _post(client, url, body):
    r = await client.post(f"{url}/v1/completions", json=body)
    return r.status_code, r.json()


def together(server, requests):
    """[(prompt, kv_policy)] sent at once: (status, body) of each, in order."""
    async def run():
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*(_post(client, server.url, {
                "prompt": p, "max_tokens": GEN, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "kv_policy": policy}) for p, policy in requests))
    return asyncio.run(run())


def errors(server, stage):
    return metric(server, "kvsieve_request_errors_total", policy="test_faulty", stage=stage)


def assert_failed_naming_the_policy(status, body, stage):
    assert status == 500, body
    err = body["error"]
    assert err["type"] == "server_error"
    assert "'test_faulty'" in err["message"] and f"failed in {stage}" in err["message"], err


def test_a_failing_decision_ends_its_group_only(server):
    solo = [complete(server, prompt(i), policy, max_tokens=GEN)["choices"][0]["token_ids"] for i, policy in enumerate(OTHERS)]
    before = errors(server, "decide")
    batch = [(prompt(i), policy) for i, policy in enumerate(OTHERS)]
    batch += [(prompt(10 + j), faulty(fail_in="decide", fail_after=4)) for j in range(2)]
    out = together(server, batch)
    for i, (status, body) in enumerate(out[:len(OTHERS)]):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == solo[i], OTHERS[i]
    for status, body in out[len(OTHERS):]:
        assert_failed_naming_the_policy(status, body, "decide")
    assert errors(server, "decide") - before == 2
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert region_idle(server), "region pages still in use after every request ended"
    # The same policy serves the next request that does not ask it to fail.
    assert complete(server, prompt(20), faulty())["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stage", ["admit", "step_inputs", "prefill", "tokens"])
def test_every_stage_of_policy_code_is_isolated(server, stage):
    before = errors(server, stage)
    # A prompt selection runs only for a prompt in the region.
    policy = faulty(fail_in=stage, compress_prompt=stage == "prefill")
    status, body = together(server, [(prompt(30), policy), (prompt(31), OTHERS[1])])[0]
    assert_failed_naming_the_policy(status, body, stage)
    assert errors(server, stage) - before == 1
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert region_idle(server)


def test_a_failing_stream_gets_an_error_event_then_done(server):
    async def run():
        async with httpx.AsyncClient(timeout=600) as client:
            body = {"prompt": prompt(40), "max_tokens": GEN, "temperature": 0, "ignore_eos": True, "stream": True,
                    "kv_policy": faulty(fail_in="decide", fail_after=3)}
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                return [line async for line in asse_lines(r)]
    lines = [line for line in asyncio.run(run()) if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "test_faulty" in lines[-2], lines[-3:]
    assert region_idle(server)


def test_out_of_memory_in_a_decision_retries_in_smaller_chunks(server):
    # Decisions over more than one row raise out of memory: every decision
    # is retried row by row and the requests finish with the tokens they
    # produce without the fault.
    prompts = [prompt(50 + i) for i in range(4)]
    clean = together(server, [(p, faulty()) for p in prompts])
    before = metric(server, "kvsieve_decision_oom_retries_total", policy="test_faulty")
    retried = together(server, [(p, faulty(oom_above=1)) for p in prompts])
    assert metric(server, "kvsieve_decision_oom_retries_total", policy="test_faulty") > before
    for (s0, b0), (s1, b1) in zip(clean, retried):
        assert s0 == s1 == 200, (b0, b1)
        assert b1["choices"][0]["token_ids"] == b0["choices"][0]["token_ids"]
    assert region_idle(server)


def test_nan_logits_end_that_request_only(server):
    # Its logits turn NaN from its fourth decode token on (test_faulty's
    # poison_at) and it samples (temperature 1): SGLang's multinomial fails on
    # NaN probabilities, which without radix_ext/logit_guard.py takes the
    # scheduler down. Beside it, greedy rows of other policies keep their solo
    # tokens. A second poisoned request ends with the poisoned token (its
    # max_tokens), after its pages came back: its finish is relabelled.
    others = [OTHERS[0], OTHERS[2], OTHERS[5], "full"]
    solo = [complete(server, prompt(55 + i), policy, max_tokens=GEN)["choices"][0]["token_ids"]
            for i, policy in enumerate(others)]
    before = errors(server, "logits")

    async def run():
        async with httpx.AsyncClient(timeout=600) as client:
            bodies = [{"prompt": prompt(55 + i), "max_tokens": GEN, "temperature": 0, "kv_policy": policy}
                      for i, policy in enumerate(others)]
            bodies += [{"prompt": prompt(59), "max_tokens": GEN, "temperature": 1.0, "kv_policy": faulty(poison_at=3)},
                       {"prompt": prompt(60), "max_tokens": 5, "temperature": 1.0, "kv_policy": faulty(poison_at=3)}]
            return await asyncio.gather(*(_post(client, server.url, {"ignore_eos": True, "return_token_ids": True,
                                                                      **body}) for body in bodies))

    out = asyncio.run(run())
    for i, (status, body) in enumerate(out[:len(others)]):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == solo[i], others[i]
    assert_failed_naming_the_policy(*out[len(others)], "logits")
    status, body = out[len(others) + 1]
    assert status == 500 and "not finite" in body["error"]["message"], body
    assert errors(server, "logits") - before == 2
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert region_idle(server)
    assert complete(server, prompt(61), faulty())["choices"][0]["finish_reason"] == "length"
