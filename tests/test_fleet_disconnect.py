"""A client that goes away mid-stream: the request is aborted in the engine at
once (SGLang's running-request gauge drops, the compressed region's pages
come back) and the server logs no traceback."""

import threading
import time

import httpx

from prometheus_client.parser import text_string_to_metric_families
from kvsieve.service.sse_client import sse_lines


def gauge(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_for(predicate, timeout: float, step: float = 0.05) -> float | None:
    """Seconds until predicate() held, or None past the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(step)
    return None


def test_disconnect_mid_stream_aborts_in_the_engine(llama_server):
    s = llama_server
    log_start = len(s.log())
    assert gauge(s.url, "sglang:num_running_reqs") == 0
    # 1900 tokens take the tiny model tens of seconds on CPU: a gauge back at
    # 0 within seconds of the disconnect is the abort, not the request's end.
    body = {"prompt": "the model keeps thinking", "max_tokens": 1900, "ignore_eos": True, "stream": True,
            "kv_policy": {"name": "streaming", "budget": 64}}
    chunks = 0
    hang_up = threading.Event()
    reading = threading.Event()

    def client():
        nonlocal chunks
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in sse_lines(r):
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks >= 3:
                        reading.set()
                if hang_up.is_set():
                    break  # leaving the with-block closes the connection mid-stream

    t = threading.Thread(target=client)
    t.start()
    assert reading.wait(120)
    # SGLang publishes the gauge at prefill and every few decode steps.
    assert wait_for(lambda: gauge(s.url, "sglang:num_running_reqs") >= 1, 30) is not None
    assert gauge(s.url, "kvsieve_region_pages", state="used") > 0
    hang_up.set()
    t.join(30)
    assert not t.is_alive()
    dropped_in = wait_for(lambda: gauge(s.url, "sglang:num_running_reqs") == 0, 10)
    print(f"running-request gauge back to 0 {dropped_in} s after the disconnect, after {chunks} chunks")
    assert dropped_in is not None and dropped_in < 3.0, dropped_in
    assert chunks < 1900 // 2  # it was cut off, not finished
    # Every page of its compressed KV is back.
    assert wait_for(lambda: gauge(s.url, "kvsieve_region_pages", state="used") == 0, 10) is not None
    assert gauge(s.url, "kvsieve_region_reserved_pages") == 0
    log = s.log()[log_start:]
    assert "Traceback" not in log and "aclose()" not in log and "failed" not in log, log[-3000:]
    # The server keeps serving.
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "one", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
