"""The store behind one interface: file and real Redis back-ends, presets,
calibration artifacts by (kind, model), hashed API keys, versioned change
detection, and a server's mirror riding out a Redis outage."""

import json
import logging
import time

import pytest

from conftest import kvsieve_cli
from kvsieve.service.auth import new_key, verify
from kvsieve.service.store import FileStore, StoreUnavailable, open_store
from kvsieve.service.store_cache import StoreMirror


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        yield FileStore(tmp_path / "store.json")
    else:
        server = request.getfixturevalue("redis_server")
        s = open_store(server.url)
        yield s
        s.close()


def test_presets_round_trip_and_versions(store):
    v0 = store.version()
    store.set_preset("tight", {"name": "snapkv", "budget": 128})
    store.set_preset("loose", {"name": "full"})
    assert store.version() == v0 + 2
    assert store.get_preset("tight") == {"name": "snapkv", "budget": 128}
    assert set(store.list_presets()) == {"tight", "loose"}
    assert store.delete_preset("loose") is True
    assert store.delete_preset("loose") is False
    snap = store.snapshot()
    assert snap.presets == {"tight": {"name": "snapkv", "budget": 128}}
    assert snap.version == store.version()


def test_artifacts_by_kind_and_model(store):
    thresholds = {"layers": [[0.1, 0.2], [0.3, 0.4]]}
    store.put_artifact("thinkv-thresholds", "Qwen3-8B", thresholds)
    store.put_artifact("skipkv-vectors", "Qwen3-8B", [1.5, -2.0])
    store.put_artifact("thinkv-thresholds", "SmolLM2-135M", {"layers": []})
    assert store.get_artifact("thinkv-thresholds", "Qwen3-8B") == thresholds
    assert store.get_artifact("skipkv-vectors", "Qwen3-8B") == [1.5, -2.0]
    assert store.get_artifact("skipkv-vectors", "SmolLM2-135M") is None
    assert store.list_artifacts() == [("skipkv-vectors", "Qwen3-8B"), ("thinkv-thresholds", "Qwen3-8B"),
                                      ("thinkv-thresholds", "SmolLM2-135M")]
    store.put_artifact("skipkv-vectors", "Qwen3-8B", [0.0])  # replaces
    assert store.get_artifact("skipkv-vectors", "Qwen3-8B") == [0.0]
    with pytest.raises(ValueError):
        store.put_artifact("", "m", 1)


def test_keys_are_stored_hashed(store):
    key, record = new_key("alice", rate_per_s=2.0, burst=3)
    store.put_key(record)
    keys = store.list_keys()
    assert verify(key, keys) == record
    assert verify(key[:-1] + ("A" if key[-1] != "A" else "B"), keys) is None
    assert verify("ksv-000000000000-" + "x" * 43, keys) is None
    assert verify(None, keys) is None
    secret = key.split("-", 2)[2]
    stored = json.dumps({k: v.to_json() for k, v in keys.items()})
    assert secret not in stored and key not in stored
    assert store.delete_key(record.key_id) and verify(key, store.list_keys()) is None


def test_mirror_sees_changes_without_restart(store):
    mirror = StoreMirror(store, "test", refresh_interval_s=0.05).start()
    try:
        store.set_preset("live", {"name": "full"})
        deadline = time.monotonic() + 5
        while "live" not in mirror.presets and time.monotonic() < deadline:
            time.sleep(0.02)
        assert mirror.presets == {"live": {"name": "full"}}
        # A preset that does not validate is dropped by the mirror, not served.
        store.set_preset("broken", {"name": "no-such-policy"})
        time.sleep(0.3)
        assert "broken" not in mirror.presets and "live" in mirror.presets
    finally:
        mirror.stop()


def test_mirror_rides_out_a_redis_outage(redis_server, caplog):
    store = open_store(redis_server.url, timeout_s=0.2)
    key, record = new_key("bob")
    store.put_key(record)
    store.set_preset("kept", {"name": "full"})
    mirror = StoreMirror(store, "redis", refresh_interval_s=0.1)
    caplog.set_level(logging.WARNING, logger="kvsieve.service.store_cache")
    mirror.refresh()
    assert mirror.up and "kept" in mirror.presets

    redis_server.stop()
    with pytest.raises(StoreUnavailable):
        store.version()
    assert mirror.refresh() is False
    assert mirror.refresh() is False
    assert not mirror.up
    # The last snapshot keeps serving: presets and keys.
    assert mirror.presets == {"kept": {"name": "full"}}
    assert verify(key, mirror.keys) == record
    warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1, warnings  # one line per outage, not one per poll
    assert key not in caplog.text

    redis_server.start()
    store.set_preset("after", {"name": "full"})
    assert mirror.refresh() is True and mirror.up
    assert set(mirror.presets) == {"kept", "after"}
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    mirror.stop()


def test_cli_presets_and_keys(redis_server):
    env = {"KVSIEVE_STORE__URL": redis_server.url}
    assert kvsieve_cli("presets", "set", "p1", '{"name": "snapkv", "budget": 64}', env=env).returncode == 0
    assert json.loads(kvsieve_cli("presets", "get", "p1", env=env).stdout) == {"name": "snapkv", "budget": 64}
    listed = kvsieve_cli("presets", "list", env=env).stdout
    assert listed.startswith("p1\t")
    bad = kvsieve_cli("presets", "set", "p2", '{"name": "snapkv", "budget": -1}', env=env)
    assert bad.returncode == 2 and "budget" in bad.stderr
    bad = kvsieve_cli("presets", "set", "full", '{"name": "full"}', env=env)
    assert bad.returncode == 2 and "name of a policy" in bad.stderr
    assert kvsieve_cli("presets", "delete", "p1", env=env).returncode == 0
    assert kvsieve_cli("presets", "get", "p1", env=env).returncode == 1

    created = kvsieve_cli("keys", "create", "carol", "--rate", "5", env=env)
    key = created.stdout.strip()
    assert created.returncode == 0 and key.startswith("ksv-")
    listed = kvsieve_cli("keys", "list", env=env).stdout
    assert "carol" in listed and key not in listed
    assert verify(key, open_store(redis_server.url).list_keys()).name == "carol"

    redis_server.stop()
    down = kvsieve_cli("presets", "list", env=env)
    assert down.returncode == 1 and "unreachable" not in down.stdout and "redis store" in down.stderr
