"""Start-up and shutdown are clean: no SGLang child survives SIGTERM or Ctrl-C."""

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from conftest import kill_tree, start_server

SIGNALS = [signal.SIGTERM, signal.SIGINT]


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    """A server per signal, started at once: their starts overlap."""
    with ThreadPoolExecutor(len(SIGNALS)) as pool:
        started = {sig: pool.submit(start_server, tmp_path_factory.mktemp(f"shutdown-{sig.name}"),
                                    "--model", str(tiny_llama)) for sig in SIGNALS}
    servers = {sig: f.result() for sig, f in started.items() if f.exception() is None}
    failed = [f.exception() for f in started.values() if f.exception() is not None]
    if failed:
        for server in servers.values():
            kill_tree(server.proc)
        raise failed[0]
    yield servers
    for server in servers.values():  # a test that failed before its stop
        if server.proc.poll() is None:
            kill_tree(server.proc)


@pytest.mark.parametrize("sig", SIGNALS)
def test_no_child_survives(sig, servers):
    server = servers[sig]
    # After a first request SGLang has installed its own SIGTERM handler.
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "one", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children, "SGLang starts scheduler and detokenizer processes"
    assert server.stop(sig, timeout=60) == 0, server.log()
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"survivors: {[p.pid for p in alive]}\n{server.log()}"
