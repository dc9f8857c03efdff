"""tests/conftest.py's start_server: a port that was free when chosen can
be taken by another process while the engine starts (~20 s; the suite runs
servers on two workers at once). The server then exits with "address
already in use", and start_server starts it again on another port instead
of failing the tests that need it (seen once in CI, 2026-11-30)."""

import socket

import conftest


def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(tiny_llama, tmp_path, monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    ports = iter([taken])
    real = conftest.free_port
    monkeypatch.setattr(conftest, "free_port", lambda: next(ports, None) or real())
    try:
        server = conftest.start_server(tmp_path, "--model", str(tiny_llama))
        try:
            assert not server.url.endswith(f":{taken}")
            assert "address already in use" in (tmp_path / f"server-{taken}.log").read_text()
            assert server.model == "tiny-llama"
        finally:
            server.stop()
    finally:
        held.close()
