"""kv_policy {"name": "auto", ...} (service/auto_policy.py) on real servers:
without an artifact the documented default, said so in kv_usage; with one,
the choice follows its points; the 400s name the field; and `kvsieve
calibrate auto` measures the points through a real engine and stores them."""

import json
import time

import httpx
import pytest

from conftest import kvsieve_cli
from kvsieve.service.auto_policy import ARTIFACT_KIND, AutoPolicy, check_artifact, choose, shipped_artifact
from kvsieve.service.default_model import DEFAULT_MODEL_NAME
from kvsieve.service.store import FileStore, open_store

MODEL = "tiny-llama"

#: Points as `kvsieve calibrate auto` writes them (values chosen for the test).
ARTIFACT = {"model": MODEL, "points": [
    {"kv_policy": {"name": "full"}, "kv_fraction": 1.0, "quality": 1.0},
    {"kv_policy": {"name": "streaming", "budget": 16}, "kv_fraction": 0.05, "quality": 0.5},
    {"kv_policy": {"name": "snapkv", "budget": 32}, "kv_fraction": 0.09, "quality": 0.9},
    {"kv_policy": {"name": "h2o", "budget_ratio": 0.25, "compress_prompt": True}, "kv_fraction": 0.22,
     "quality": 0.97},
    # A point this server cannot run (no such policy) is left out of the choice.
    {"kv_policy": {"name": "not_served", "budget": 8}, "kv_fraction": 0.01, "quality": 1.0},
]}


def _drop_artifact(store) -> None:
    # The store has no delete; remove the key the way put_artifact wrote it,
    # bumping the version so that the server's mirror sees the change.
    store._write(lambda p: p.delete(store._artifact_key(ARTIFACT_KIND, MODEL)),
                 lambda p: p.srem(store._k("artifacts"), f"{ARTIFACT_KIND}\n{MODEL}"))


@pytest.fixture
def store(guarded_server):
    s = open_store(guarded_server.redis.url)
    _drop_artifact(s)
    yield s
    _drop_artifact(s)
    s.close()


def _chat(server, kv_policy) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers(), timeout=120, json={
        "messages": [{"role": "user", "content": "one two three four five six seven eight nine ten"}],
        "max_tokens": 8, "temperature": 0, "kv_policy": kv_policy})


def _auto(server, **constraint) -> dict:
    resp = _chat(server, {"name": "auto", **constraint})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["kv_usage"]
    assert usage["policy"] == usage["auto"]["policy"]  # what the engine ran is what auto chose
    return usage


def _wait_for_source(server, source: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while _auto(server, max_kv_fraction=0.5)["auto"]["source"] != source:
        assert time.monotonic() < deadline, f"the server never saw the artifact ({source})"
        time.sleep(0.2)


def test_without_an_artifact_auto_falls_back_to_the_documented_default(guarded_server, store):
    _wait_for_source(guarded_server, "default")
    usage = _auto(guarded_server, max_kv_fraction=0.1)
    assert usage["policy"] == "h2o"
    auto = usage["auto"]
    assert auto["source"] == "default" and auto["max_kv_fraction"] == 0.1 and auto["model"] == MODEL
    assert auto["budget_ratio"] == 0.1 and auto["compress_prompt"] is True
    assert auto["reason"].startswith(f"no 'auto' calibration artifact for model '{MODEL}'")
    usage = _auto(guarded_server, min_quality=0.95)
    assert usage["policy"] == "full" and usage["auto"]["source"] == "default"
    # A malformed artifact is no artifact either, and the reason says so.
    store.put_artifact(ARTIFACT_KIND, MODEL, {"model": MODEL, "points": [{"kv_policy": {"name": "h2o"}}]})
    deadline = time.monotonic() + 20
    while "malformed" not in _auto(guarded_server, max_kv_fraction=0.5)["auto"]["reason"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_the_choice_follows_the_artifact(guarded_server, store):
    store.put_artifact(ARTIFACT_KIND, MODEL, ARTIFACT)
    _wait_for_source(guarded_server, "artifact")
    # At most 10% of the KV: the best quality among the points that small.
    usage = _auto(guarded_server, max_kv_fraction=0.1)
    assert usage["policy"] == "snapkv"
    assert usage["auto"] == {"max_kv_fraction": 0.1, "model": MODEL, "source": "artifact", "origin": "store",
                             "policy": "snapkv",
                             "budget": 32, "expected_kv_fraction": 0.09, "expected_quality": 0.9, "met": True}
    # At least 95% of full's quality: the smallest KV that gets there.
    usage = _auto(guarded_server, min_quality=0.95)
    assert usage["policy"] == "h2o" and usage["auto"]["budget_ratio"] == 0.25
    assert usage["auto"]["compress_prompt"] is True and usage["evicted_tokens"] >= 0
    assert _auto(guarded_server, min_quality=0.99)["policy"] == "full"
    # Nothing is that small: the smallest point, said to miss the bound.
    usage = _auto(guarded_server, max_kv_fraction=0.01)
    assert usage["policy"] == "streaming" and usage["auto"]["met"] is False
    # A new artifact reaches the running server without a restart.
    store.put_artifact(ARTIFACT_KIND, MODEL, {"model": MODEL, "points": [
        {"kv_policy": {"name": "h2o", "budget": 24}, "kv_fraction": 0.08, "quality": 0.93}]})
    deadline = time.monotonic() + 20
    while _auto(guarded_server, max_kv_fraction=0.1)["policy"] != "h2o":
        assert time.monotonic() < deadline
        time.sleep(0.2)


@pytest.mark.parametrize("kv_policy, param", [
    ({"name": "auto"}, "kv_policy.max_kv_fraction"),
    ({"name": "auto", "max_kv_fraction": 0}, "kv_policy.max_kv_fraction"),
    ({"name": "auto", "max_kv_fraction": "0.1"}, "kv_policy.max_kv_fraction"),
    ({"name": "auto", "min_quality": 1.5}, "kv_policy.min_quality"),
    ({"name": "auto", "max_kv_fraction": 0.1, "min_quality": 0.9}, "kv_policy.min_quality"),
    ({"name": "auto", "max_kv_fraction": 0.1, "budget": 64}, "kv_policy.budget"),
    ("auto", "kv_policy"),
])
def test_bad_auto_requests_are_400s_naming_the_field(guarded_server, kv_policy, param):
    resp = _chat(guarded_server, kv_policy)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(param + ": ")


def test_calibrate_auto_measures_through_the_engine_and_stores_the_points(llama_server, tiny_llama, tmp_path):
    store_path = tmp_path / "store.json"
    done = kvsieve_cli(
        "calibrate", "auto", "--model", str(tiny_llama), "--url", llama_server.url, "--policies", "streaming",
        "--budgets", "r0.5", "--math", "1", "--math-max-tokens", "8", "--needle-lengths", "64",
        "--needle-depths", "0.5", "--da-distances", "64", "--da-samples", "1", "--concurrency", "1",
        "--results", str(tmp_path / "grid.json"), env={"KVSIEVE_STORE__URL": f"file://{store_path}"}, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval grid" in done.stderr  # the progress bar
    stored = FileStore(store_path).get_artifact(ARTIFACT_KIND, MODEL)
    assert stored["model"] == MODEL and stored["budgets"] == "r0.5"
    kinds = [p["kv_policy"] for p in stored["points"]]
    assert kinds == [{"name": "full"}, {"name": "streaming", "budget_ratio": 0.5, "compress_prompt": True}]
    point = stored["points"][1]
    assert 0 < point["kv_fraction"] < 1 and point["quality"] >= 0
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert set(grid["cells"]) == {f"{t}|{p}" for t in ("math", "needle", "da") for p in ("full|-", "streaming|r0.5")}
    bad = kvsieve_cli("calibrate", "auto", "--model", str(tiny_llama), "--budgets", "f0.1")
    assert bad.returncode == 2 and "a point needs a budget a request can carry" in bad.stderr

    # The same points from the grid's results file, without running it again,
    # also written where kvsieve ships artifacts from.
    shipped = tmp_path / "shipped.json"
    again = kvsieve_cli("calibrate", "auto", "--model", str(tiny_llama), "--from-results", str(tmp_path / "grid.json"),
                        "--artifact-out", str(shipped), env={"KVSIEVE_STORE__URL": f"file://{tmp_path / 's2.json'}"},
                        timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    written = json.loads(shipped.read_text())
    assert written["points"] == stored["points"] and written["tasks"] == ["da", "math", "needle"]
    assert FileStore(tmp_path / "s2.json").get_artifact(ARTIFACT_KIND, MODEL)["points"] == stored["points"]
    # A grid whose math prompts followed each policy's default has no single
    # kv_policy per point: refused, saying why.
    grid["meta"]["tasks_config"]["compress_prompt"] = "task"
    (tmp_path / "mixed.json").write_text(json.dumps(grid))
    mixed = kvsieve_cli("calibrate", "auto", "--model", str(tiny_llama), "--from-results", str(tmp_path / "mixed.json"))
    assert mixed.returncode == 2 and "a point needs one kv_policy for every task" in mixed.stderr


def test_a_shipped_artifact_stands_in_until_the_store_has_one(tmp_path):
    """The artifact committed for the embedded model (service/calibrations/auto)
    answers auto on a fresh clone; a store artifact replaces it."""
    shipped = shipped_artifact(DEFAULT_MODEL_NAME)
    assert shipped is not None and shipped["model"] == DEFAULT_MODEL_NAME
    store = FileStore(tmp_path / "store.json")
    auto = AutoPolicy(DEFAULT_MODEL_NAME)
    for constraint, x in (("max_kv_fraction", 0.1), ("min_quality", 0.95)):
        kv_policy, report = auto.resolve({"name": "auto", constraint: x}, store, store.version())
        point, met = choose(check_artifact(shipped), constraint, x)
        assert kv_policy == point.kv_policy and report["met"] is met
        assert report["source"] == "artifact" and report["origin"] == "shipped"
    store.put_artifact(ARTIFACT_KIND, DEFAULT_MODEL_NAME, {"model": DEFAULT_MODEL_NAME, "points": [
        {"kv_policy": {"name": "h2o", "budget": 24}, "kv_fraction": 0.08, "quality": 0.93}]})
    kv_policy, report = auto.resolve({"name": "auto", "max_kv_fraction": 0.1}, store, store.version())
    assert kv_policy == {"name": "h2o", "budget": 24} and report["origin"] == "store"
    # Nothing shipped for another model: the documented default, said so.
    kv_policy, report = AutoPolicy("no-such-model").resolve({"name": "auto", "max_kv_fraction": 0.1}, store,
                                                            store.version())
    assert report["source"] == "default" and kv_policy["name"] == "h2o"
