"""An idle server leaves the CPU alone: SGLang's scheduler spins on its
sockets unless sleep_on_idle is on, and a spinning scheduler takes a core
from every other process on the machine (other replicas, the test suite's
other servers)."""

import time

import httpx

from helpers.procs import tree_cpu_seconds


def test_an_idle_server_uses_almost_no_cpu(llama_server):
    r = httpx.post(f"{llama_server.url}/v1/completions", timeout=60,
                   json={"prompt": [7, 8, 9], "max_tokens": 4, "kv_policy": "full"})
    assert r.status_code == 200, r.text
    time.sleep(2)  # the request's last steps and the idle housekeeping after them
    before, start = tree_cpu_seconds(llama_server.proc.pid), time.monotonic()
    time.sleep(5)
    used = (tree_cpu_seconds(llama_server.proc.pid) - before) / (time.monotonic() - start)
    # A spinning scheduler shows here as a large share of a core even on a
    # loaded machine; one that sleeps wakes once a second for a few ms.
    assert used < 0.05, f"idle server used {used:.0%} of a core"
