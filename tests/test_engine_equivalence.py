"""`full` through kvsieve equals a plain SGLang Engine, token for token, and
the policy reaches SGLang's scheduler through SamplingParams.custom_params."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

HELPER = Path(__file__).parent / "helpers" / "plain_engine.py"
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(40, 90))]
MAX_NEW = 40


def plain_engine(model_dir, requests):
    out = subprocess.run([sys.executable, str(HELPER), str(model_dir), json.dumps(requests)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


GREEDY = [{"input_ids": p, "max_new_tokens": MAX_NEW} for p in PROMPTS]
# The same prompt with and without a kv_policy in custom_params.
POLICY_PAIR = [{"input_ids": PROMPTS[0], "max_new_tokens": 5,
                "custom_params": {"kv_policy": {"name": "full", "params": {}}}},
               {"input_ids": PROMPTS[0], "max_new_tokens": 5, "custom_params": None}]


@pytest.fixture(scope="module")
def plain_llama(tiny_llama):
    """One plain Engine on the tiny Llama for both tests that need one: the
    greedy runs first, then the kv_policy pair (requests run one by one)."""
    return plain_engine(tiny_llama, GREEDY + POLICY_PAIR)


def kvsieve_greedy(server, input_ids):
    body = {"prompt": input_ids, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_policy": "full"}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_full_greedy_equals_plain_sglang(arch, request):
    server = request.getfixturevalue("llama_server" if arch == "llama" else "qwen3_server")
    if arch == "llama":
        expected = request.getfixturevalue("plain_llama")[:len(GREEDY)]
    else:
        expected = plain_engine(request.getfixturevalue(f"tiny_{arch}"), GREEDY)
    for prompt, ref in zip(PROMPTS, expected):
        got = kvsieve_greedy(server, prompt)
        assert len(got) == MAX_NEW
        assert got == ref["output_ids"]
    # The tiny model is not degenerate: the comparison covers varied tokens.
    assert len(set(expected[0]["output_ids"])) > 3


def test_kv_policy_arrives_in_the_scheduler(plain_llama):
    # A plain Engine, no kvsieve front end: the kvsieve plugin (loaded by SGLang
    # in its spawned scheduler process) reads custom_params there and reports
    # per-token usage back; a request without kv_policy gets no report.
    with_policy, without = plain_llama[len(GREEDY):]
    records = with_policy["meta_info"]["kvsieve_kv_usage"]
    assert len(records) == 5 and records[:-1] == [None] * 4
    assert records[-1]["policy"] == "full"
    assert records[-1]["private_tokens"] == len(PROMPTS[0]) - records[-1]["prefix_cache_hit_tokens"] + 5
    assert "kvsieve_kv_usage" not in without["meta_info"]
