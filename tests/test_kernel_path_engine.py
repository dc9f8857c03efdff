"""The GPU's decode path on CPU: a real `kvsieve serve` whose compressed rows
run the Triton decode kernel (through Triton's interpreter), as they do on a
GPU. Greedy outputs equal the PyTorch-reference server's and `full`'s where
the budget covers everything."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import start_server

PROMPT = list(range(100, 140))
POLICIES = [
    "full",
    {"name": "h2o", "budget": 100, "compress_prompt": True},  # attention observations
    {"name": "longflow", "budget": 100},  # ||p v|| observations
    {"name": "streaming", "budget": 100},  # no observations
    {"name": "h2o", "budget": 12},  # evicting
]


@pytest.fixture(scope="module")
def kernel_server(tiny_llama, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("logs"), "--model", str(tiny_llama),
                          env={"TRITON_INTERPRET": "1", "KVSIEVE_DECODE_KERNEL": "triton"})
    yield server
    server.stop()


def greedy(server, policy):
    r = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": server.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "kv_policy": policy})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_kernel_path_matches_the_reference_path(kernel_server, llama_server):
    assert "runs the Triton kernel" in kernel_server.log()
    with_kernel = [greedy(kernel_server, p) for p in POLICIES]
    reference = [greedy(llama_server, p) for p in POLICIES]
    assert with_kernel == reference
    # Budgets covering the whole generation give `full`'s tokens.
    assert with_kernel[1] == with_kernel[2] == with_kernel[3] == with_kernel[0]


def test_crystalcache_decides_beside_another_policy_in_one_decode_batch(kernel_server):
    """crystalcache observes the first layer only but decides on every layer
    at its breath cycle; beside rows of a policy that keeps no slot state
    (not the whole batch), the kernel path's view of a later layer holds
    none, and writing it back crashed the scheduler (the GPU grid, 512
    mixed requests)."""
    policies = [{"name": "crystalcache", "budget": 64, "params": {"sinks": 2, "recent": 16, "breath": 4}},
                {"name": "streaming", "budget": 12}]  # keeps no slot state either

    # Prompts of their own: a prompt the other request put in the radix
    # cache first would be kept whole, outside crystalcache's budget.
    prompts = [list(range(150, 270)), list(range(280, 400))]  # apart from PROMPT; the vocabulary has 410 ids

    def run(policy, prompt):
        return httpx.post(f"{kernel_server.url}/v1/completions", timeout=300, json={
            "model": kernel_server.model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "kv_policy": policy})

    with ThreadPoolExecutor(len(policies)) as pool:
        answers = list(pool.map(run, policies, prompts))
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24
    usage = [r.json()["kv_usage"] for r in answers]
    assert usage[0]["policy"] == "crystalcache" and usage[0]["evicted_tokens"] > 0
    assert usage[1]["evicted_tokens"] > 0
