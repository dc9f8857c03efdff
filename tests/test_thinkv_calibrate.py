"""`kvsieve calibrate thinkv` and the artifact's way to the policy: the CLI on
the tiny Llama (real transformers decode), the store round trip, and the
fallback when a model has no usable artifact."""

import argparse
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import kvsieve_cli
from kvsieve.policies import get_policy
from kvsieve.policies.base import ModelInfo
from kvsieve.policies.thinkv.calibration import ARTIFACT_KIND, SERVED_MODEL_ENV, fallback, lookup
from kvsieve.service import calibrate as calibrate_cli
from kvsieve.service.calibrate import calibration_prompts
from kvsieve.service.store import FileStore


@pytest.fixture
def file_store(tmp_path, monkeypatch):
    """A fresh file store as the settings' store of this process."""
    path = tmp_path / "store.json"
    monkeypatch.setenv("KVSIEVE_STORE__URL", f"file://{path}")
    monkeypatch.delenv("KVSIEVE_CONFIG", raising=False)
    monkeypatch.delenv(SERVED_MODEL_ENV, raising=False)
    return FileStore(path)


def test_calibrating_the_tiny_model_shows_progress_and_refuses_without_three_modes(tiny_llama, file_store):
    # A random-weight model's sparsity has one mode per layer (measured: about
    # 0.4-0.95 around a single peak), so no layer qualifies: exit 1, nothing stored.
    done = kvsieve_cli("calibrate", "thinkv", "--model", str(tiny_llama), "--prompts", "2",
                       "--max-new-tokens", "24", env={"KVSIEVE_STORE__URL": f"file://{file_store.path}"},
                       timeout=300)
    assert done.returncode == 1, done.stderr
    assert "thinkv calibration of tiny-llama" in done.stderr  # the progress bar
    assert "no layer shows 3 sparsity modes in every prompt (2 prompts, 2 layers)" in done.stderr
    assert file_store.list_artifacts() == []
    bad = kvsieve_cli("calibrate", "thinkv", "--model", str(tiny_llama), "--prompts", "0")
    assert bad.returncode == 2 and "--prompts must be at least 1" in bad.stderr


def test_an_artifact_written_by_calibrate_reaches_the_policy(tiny_llama, file_store, monkeypatch):
    # The model's traces replaced by two layers of three clear modes (0.3, 0.6,
    # 0.9; minima at 0.45 and 0.75 by symmetry) and one unimodal layer.
    rng = np.random.default_rng(1)

    def traces(model_dir, prompts, max_new_tokens, progress=None):
        assert model_dir == str(tiny_llama) and len(prompts) == 3
        modes = lambda sd: np.concatenate([rng.normal(c, sd, 150) for c in (0.3, 0.6, 0.9)])  # noqa: E731
        return [np.stack([rng.normal(0.5, 0.05, 450), modes(0.03), modes(0.03)], axis=1) for _ in prompts]

    monkeypatch.setattr(calibrate_cli, "sparsity_traces", traces)
    args = argparse.Namespace(model=str(tiny_llama), name=None, prompts=3, max_new_tokens=8, max_layers=4, seed=0)
    assert calibrate_cli.run(args, lambda: file_store) == 0
    stored = file_store.get_artifact(ARTIFACT_KIND, "tiny-llama")
    assert stored["model"] == "tiny-llama" and stored["layers"] == [1, 2]
    assert stored["thresholds"] == pytest.approx([0.45, 0.75], abs=0.02)
    # The scheduler's lookup: the settings' store, keyed by the served name
    # (here the checkpoint directory's, as `kvsieve serve` names it).
    policy = get_policy("thinkv")()
    policy.bind_model(ModelInfo(name=str(tiny_llama), num_layers=3, num_kv_heads=2, num_q_heads=4, head_dim=16))
    assert policy.calibration.fallback is None and policy.calibration.layers == (1, 2)
    assert policy.begin_request(policy.Params(), 3, 2).fallback is None
    # `kvsieve serve --served-model-name other` looks for "other": none, so the fallback.
    monkeypatch.setenv(SERVED_MODEL_ENV, "other")
    assert lookup(str(tiny_llama), 3).fallback == "uncalibrated"


def test_fallbacks_name_their_reason(file_store):
    # Uncalibrated: 4 layers around 2/3 of the depth: 30 layers -> centre 20,
    # layers 18-21; 2 layers -> both.
    assert fallback("m", 30, "x").layers == (18, 19, 20, 21)
    assert lookup("/models/m", 2).layers == (0, 1)
    assert lookup("/models/m", 2).fallback == "uncalibrated"
    file_store.put_artifact(ARTIFACT_KIND, "m", {"model": "m", "layers": [5], "thresholds": [0.4, 0.8]})
    assert lookup("/models/m", 4).fallback.startswith("bad_artifact")  # layer 5 of 4
    file_store.put_artifact(ARTIFACT_KIND, "m", {"model": "m", "layers": [1], "thresholds": [0.8, 0.4]})
    assert lookup("/models/m", 4).fallback.startswith("bad_artifact")  # thresholds out of order
    file_store.put_artifact(ARTIFACT_KIND, "m", {"model": "m", "layers": [1], "thresholds": [0.4, 0.8]})
    assert lookup("/models/m", 4).thresholds == (0.4, 0.8)
    unreachable = SimpleNamespace(get_artifact=lambda kind, model: (_ for _ in ()).throw(ConnectionError("down")))
    assert lookup("/models/m", 4, store=unreachable).fallback.startswith("store_unavailable")


def test_prompts_are_seeded():
    assert calibration_prompts(5, seed=3) == calibration_prompts(5, seed=3)
    assert calibration_prompts(5, seed=3) != calibration_prompts(5, seed=4)
    assert len(set(calibration_prompts(8))) == 8
