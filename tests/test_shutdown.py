"""Start-up and shutdown are clean: no SGLang child survives SIGTERM or Ctrl-C."""

import signal

import httpx
import psutil
import pytest

from conftest import start_server


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_no_child_survives(sig, tiny_llama, tmp_path):
    server = start_server(tmp_path, "--model", str(tiny_llama))
    # After a first request SGLang has installed its own SIGTERM handler.
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "one", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children, "SGLang starts scheduler and detokenizer processes"
    assert server.stop(sig, timeout=60) == 0, server.log()
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"survivors: {[p.pid for p in alive]}\n{server.log()}"
