"""skipkv's adaptive steering: the α schedule, the device table the engine's
hooks read, the cue counts of the sentence book, the vectors' artifact, and
end to end through a real `kvsieve serve` on the embedded SmolLM2-135M
(calibrated here with `kvsieve calibrate skipkv`)."""

import concurrent.futures
import random
from types import SimpleNamespace

import httpx
import pytest
import torch

from conftest import kvsieve_cli, start_server
from kvsieve.policies import KVPolicyError, parse_kv_policy
from kvsieve.policies.skipkv.book import SentenceBook, delimiter_table
from kvsieve.policies.skipkv.steering import SteeringTable, alpha_schedule, token_table
from kvsieve.policies.skipkv.steering_vectors import (ARTIFACT_KIND, SteeringVectors, class_mean_difference,
                                                      default_layer, lookup)
from kvsieve.radix_ext import steering_hooks
from kvsieve.service.reasoning_traces import EXECUTION, traces
from kvsieve.service.store import FileStore
from test_compressed import metric, region_idle


# ----- the α schedule ------------------------------------------------------------------

def test_alpha_grows_by_its_step_per_revalidation_up_to_the_cap():
    assert alpha_schedule(1.25, 0.02, 2.0, 0) == 1.25
    assert alpha_schedule(1.25, 0.02, 2.0, 10) == pytest.approx(1.45)
    assert alpha_schedule(1.25, 0.02, 2.0, 1000) == 2.0
    assert alpha_schedule(1.0, 0.0, 2.0, 50) == 1.0  # no step: constant
    # Per row on the device: each row its own parameters and count.
    alpha = alpha_schedule(torch.tensor([1.0, 1.0, 0.5]), torch.tensor([0.5, 0.5, 0.1]),
                           torch.tensor([2.0, 1.2, 3.0]), torch.tensor([1, 3, 4]))
    assert alpha.tolist() == pytest.approx([1.5, 1.2, 0.9])


# ----- the table the hooks read ----------------------------------------------------------

def _table(rows=6, layers=3, hidden=8):
    torch.manual_seed(0)
    vectors = torch.randn(layers, hidden)
    newline = token_table([5, 9], "cpu", size=12)  # tokens 5 and 9 hold a newline
    return SteeringTable(rows, vectors, newline), vectors


def test_only_flagged_rows_at_a_newline_and_at_their_layer_change():
    table, vectors = _table()
    table.begin(row=2, layer=1, alpha=1.5)
    table.begin(row=4, layer=2, alpha=0.5)
    hidden = torch.randn(4, 8)
    pool_rows = torch.tensor([2, 0, 4, 3])  # batch rows -> req_pool rows; 0 and 3 are not steered
    ids = torch.tensor([5, 9, 9, 5])  # all newlines
    out = table.apply(1, hidden, ids, pool_rows)
    assert torch.allclose(out[0], hidden[0] + 1.5 * vectors[1])
    assert torch.equal(out[1:], hidden[1:])  # row 4 steers at layer 2, the others never: bit for bit
    out = table.apply(2, hidden, torch.tensor([5, 9, 7, 5]), pool_rows)  # row 4's token is no newline
    assert torch.equal(out, hidden)
    out = table.apply(2, hidden, torch.tensor([5, 9, 9, 5]), pool_rows)
    assert torch.allclose(out[2], hidden[2] + 0.5 * vectors[2]) and torch.equal(out[[0, 1, 3]], hidden[[0, 1, 3]])
    assert table.report(2) == {"steered_tokens": 1, "alpha_peak": 1.5}
    assert table.report(4) == {"steered_tokens": 1, "alpha_peak": 0.5}
    assert table.live == {1: 1, 2: 1}
    table.set_alpha(torch.tensor([2]), torch.tensor([1.75]))
    table.apply(1, hidden, ids, pool_rows)
    assert table.report(2) == {"steered_tokens": 2, "alpha_peak": 1.75}
    # Ending a request stops its row; a new request on the row starts clean.
    table.end(2, 1)
    assert torch.equal(table.apply(1, hidden, ids, pool_rows), hidden) and table.live == {2: 1}
    table.begin(row=2, layer=1, alpha=1.0)
    assert table.report(2) == {"steered_tokens": 0, "alpha_peak": 0.0}


def test_the_decoder_layer_hook_steers_decode_forwards_only():
    table, vectors = _table()
    table.begin(row=1, layer=0, alpha=2.0)

    class Layer(torch.nn.Module):  # SGLang's decoder layers return (hidden_states, residual)
        def forward(self, positions, hidden, forward_batch, residual):
            return hidden * 1.0, residual

    layer = Layer()
    layer.register_forward_hook(steering_hooks._hook(0), with_kwargs=True)
    hidden, residual = torch.randn(2, 8), torch.randn(2, 8)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True),
                            input_ids=torch.tensor([9, 9]), req_pool_indices=torch.tensor([1, 3]))
    from kvsieve.policies.skipkv import steering

    saved, steering.TABLE = steering.TABLE, table
    try:
        out, res = layer(None, hidden, batch, residual)
        assert torch.allclose(out[0], hidden[0] + 2.0 * vectors[0]) and torch.equal(out[1], hidden[1])
        assert torch.equal(res, residual)
        batch.forward_mode = SimpleNamespace(is_decode=lambda: False)  # a prefill: the prompt is never steered
        assert torch.equal(layer(None, hidden, batch, residual)[0], hidden)
    finally:
        steering.TABLE = saved


# ----- cue sentences in the sentence book ----------------------------------------------------

def test_the_book_counts_sentences_with_a_cue_token():
    # Ids: 1 "." ends a sentence, 7 is a cue ("Wait"), others plain words.
    book = SentenceBook(delimiter_table({1}, "cpu"), hidden=4, device="cpu")
    book.cue = token_table([7], "cpu")
    rs = book.open(row=3)
    tokens = [2, 7, 3, 1, 4, 5, 1, 7, 2, 1, 2, 7]  # cue sentence, plain sentence, cue sentence, open cue
    for pos, tok in enumerate(tokens):
        book.add(rs, torch.tensor([pos]), torch.tensor([tok]), torch.randn(1, 4))
        book.flush()
    rows = torch.tensor([3])
    assert book.cue_sentences[3].item() == 2 and bool(book.cue_open[3])
    assert book.revalidations(rows).tolist() == [3]
    book.add(rs, torch.tensor([12]), torch.tensor([1]), torch.randn(1, 4))  # the open one ends
    book.flush()
    assert book.revalidations(rows).tolist() == [3] and book.cue_sentences[3].item() == 3


# ----- vectors and their artifact ----------------------------------------------------------------

def test_the_vector_is_the_execution_mean_minus_the_rest():
    f = [torch.full((2, 3), v) for v in (1.0, 3.0, 10.0, 20.0)]
    s = class_mean_difference(f, [True, True, False, False])
    assert torch.equal(s, torch.full((2, 3), 2.0 - 15.0))
    with pytest.raises(ValueError, match="both classes"):
        class_mean_difference(f, [True] * 4)
    assert default_layer(30) == 20 and default_layer(2) == 1 and default_layer(1) == 0


def test_the_artifact_round_trips_and_a_missing_one_names_the_command(tmp_path):
    store = FileStore(tmp_path / "store.json")
    vectors = SteeringVectors(model="m", vectors=torch.randn(4, 6), default_layer=3, counts={"execution": 5})
    missing, why = lookup("/models/m", 4, store=store)
    assert missing is None and "kvsieve calibrate skipkv" in why and "'m'" in why
    store.put_artifact(ARTIFACT_KIND, "m", vectors.to_artifact())
    back, why = lookup("/models/m", 4, store=store)
    assert why == "" and back.default_layer == 3 and torch.allclose(back.vectors, vectors.vectors, atol=1e-5)
    assert "has 4 layers, the model 5" in lookup("/models/m", 5, store=store)[1]
    store.put_artifact(ARTIFACT_KIND, "m", {**vectors.to_artifact(), "default_layer": 9})
    assert "malformed" in lookup("/models/m", 4, store=store)[1]


def test_calibrate_writes_to_a_redis_store(tiny_llama, redis_server):
    from kvsieve.service.store import open_store

    done = kvsieve_cli("calibrate", "skipkv", "--model", str(tiny_llama), "--traces", "2", "--pool", "mean",
                       env={"KVSIEVE_STORE__URL": redis_server.url}, timeout=900)
    assert done.returncode == 0, done.stderr
    art = open_store(redis_server.url).get_artifact(ARTIFACT_KIND, "tiny-llama")
    vectors = SteeringVectors.from_artifact(art)
    assert vectors.num_layers == 2 and vectors.default_layer == 1 and art["pool"] == "mean"
    bad = kvsieve_cli("calibrate", "skipkv", "--model", str(tiny_llama), "--traces", "2", "--layer", "2",
                      env={"KVSIEVE_STORE__URL": redis_server.url}, timeout=900)
    assert bad.returncode == 2 and "--layer must be in [0, 2)" in bad.stderr


def test_traces_are_seeded_and_hold_both_classes():
    a, b = traces(12, seed=1), traces(12, seed=1)
    assert a == b and a != traces(12, seed=2)
    for t in a:
        labels = {label for _, label in t.sentences}
        assert EXECUTION in labels and len(labels) >= 2


def test_bad_steering_params_name_their_field():
    for params, field in (({"alpha": 3.0}, "alpha_max"), ({"alpha": 1.0, "alpha_max": 0.5}, "alpha_max"),
                          ({"alpha": -0.1}, "alpha"), ({"alpha_step": -1.0}, "alpha_step"),
                          ({"steering": 1}, "steering"), ({"layer": -1}, "layer"), ({"layer": True}, "layer")):
        with pytest.raises(KVPolicyError) as info:
            parse_kv_policy({"name": "skipkv", "params": params})
        assert info.value.field == f"kv_policy.params.{field}", params
    ok = parse_kv_policy({"name": "skipkv", "params": {"steering": True, "alpha": 2.0, "alpha_max": 2.0}})
    assert ok.params["steering"] is True and ok.params["alpha_step"] == 0.02


# ----- end to end: the embedded SmolLM2-135M, calibrated here -------------------------------------

PROBLEM = [{"role": "user", "content": "Solve step by step, one step per line: Ana has 34 apples and buys 3 "
                                       "boxes of 12 apples. How many apples does she have? Check your work."}]
STEERED = {"name": "skipkv", "params": {"steering": True}}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """`kvsieve calibrate skipkv` on the embedded model into a fresh file store."""
    work = tmp_path_factory.mktemp("skipkv-steering")
    store_path = work / "store.json"
    env = {"KVSIEVE_STORE__URL": f"file://{store_path}", "OMP_NUM_THREADS": "1"}
    done = kvsieve_cli("calibrate", "skipkv", "--traces", "8", env=env, timeout=900)
    return SimpleNamespace(work=work, store=FileStore(store_path), env=env, done=done)


@pytest.fixture(scope="module")
def smol_server(calibrated):
    assert calibrated.done.returncode == 0, calibrated.done.stderr
    server = start_server(calibrated.work, env=calibrated.env)  # no --model: the embedded default
    yield server
    assert server.stop() == 0, server.log()


def chat(server, kv_policy, max_tokens=80):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=900,
                   json={"messages": PROBLEM, "max_tokens": max_tokens, "temperature": 0, "kv_policy": kv_policy,
                         "return_token_ids": True})
    return r.status_code, r.json()


def test_calibrate_stores_one_vector_per_layer(calibrated):
    assert calibrated.done.returncode == 0, calibrated.done.stderr
    assert "skipkv steering calibration of SmolLM2-135M-Instruct" in calibrated.done.stderr  # the progress bar
    art = calibrated.store.get_artifact(ARTIFACT_KIND, "SmolLM2-135M-Instruct")
    vectors = SteeringVectors.from_artifact(art)
    assert vectors.vectors.shape == (30, 576) and vectors.default_layer == 20
    assert art["counts"]["execution"] > 0 and art["counts"]["other"] > 0 and art["pool"] == "newline"
    assert all(n > 0 for n in art["norms"])
    bad = kvsieve_cli("calibrate", "skipkv", "--traces", "1")
    assert bad.returncode == 2 and "--traces must be at least 2" in bad.stderr


def test_steering_changes_the_flagged_row_only(smol_server):
    solo_full = chat(smol_server, "full")
    solo_plain = chat(smol_server, "skipkv")
    # One batch: the steered row, a `full` row and an unsteered skipkv row.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        steered, full, plain = pool.map(lambda p: chat(smol_server, p), [STEERED, "full", "skipkv"])
    for code, body in (steered, full, plain, solo_full, solo_plain):
        assert code == 200, body
    text = lambda r: r[1]["choices"][0]["message"]["content"]  # noqa: E731
    assert text(full) == text(solo_full) and full[1]["choices"][0]["token_ids"] == solo_full[1]["choices"][0][
        "token_ids"]
    assert text(plain) == text(solo_plain)
    assert text(steered) != text(plain)  # same policy, steering off: another continuation
    report = steered[1]["kv_usage"]["steering"]
    assert report["layer"] == 20 and report["steered_tokens"] >= 1
    assert 1.25 <= report["alpha_peak"] <= 2.0
    assert "steering" not in plain[1]["kv_usage"] and "steering" not in full[1]["kv_usage"]
    assert region_idle(smol_server)  # every page back


def test_alpha_stays_at_its_cap(smol_server):
    code, capped = chat(smol_server, {"name": "skipkv", "params": {"steering": True, "alpha": 0.5,
                                                                    "alpha_step": 1.0, "alpha_max": 0.75}})
    assert code == 200, capped
    report = capped["kv_usage"]["steering"]
    assert report["steered_tokens"] >= 2 and report["alpha_peak"] == 0.75  # re-validated: grew, then capped
    code, flat = chat(smol_server, {"name": "skipkv", "params": {"steering": True, "alpha": 0.5, "alpha_step": 0.0,
                                                                 "layer": 10}})
    assert code == 200, flat
    assert flat["kv_usage"]["steering"]["alpha_peak"] == 0.5 and flat["kv_usage"]["steering"]["layer"] == 10
    assert region_idle(smol_server)


def test_bad_steering_requests_get_a_400_naming_the_field(smol_server):
    code, body = chat(smol_server, {"name": "skipkv", "params": {"steering": True, "layer": 30}}, max_tokens=4)
    assert code == 400 and body["error"]["param"] == "kv_policy.params.layer", body
    code, body = chat(smol_server, {"name": "skipkv", "params": {"steering": True, "alpha": 3.0}}, max_tokens=4)
    assert code == 400 and body["error"]["param"] == "kv_policy.params.alpha_max", body
    assert region_idle(smol_server)
    assert metric(smol_server, "kvsieve_region_reserved_pages") == 0


def test_a_model_without_vectors_gets_a_400_naming_the_command(llama_server):
    # The tiny Llama has no ("skipkv", "tiny-llama") artifact in its store.
    body = {"prompt": [random.randint(30, 60) for _ in range(6)], "max_tokens": 4, "temperature": 0,
            "kv_policy": STEERED}
    r = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_policy.params.steering"
    assert "kvsieve calibrate skipkv" in error["message"] and "tiny-llama" in error["message"]
    assert region_idle(llama_server)
