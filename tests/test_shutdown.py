"""Start-up and shutdown are clean: no SGLang child survives SIGTERM or Ctrl-C."""

import signal

import psutil
import pytest

from conftest import start_server


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_no_child_survives(sig, tiny_llama, tmp_path):
    server = start_server(tmp_path, "--model", str(tiny_llama))
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children, "SGLang starts scheduler and detokenizer processes"
    assert server.stop(sig, timeout=60) == 0, server.log()
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"survivors: {[p.pid for p in alive]}\n{server.log()}"
