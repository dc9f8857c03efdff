"""The built-in `<policy>-paper` presets (issue #30): each validates, every
setting it makes names the paper section it comes from, the papers' values,
and their names are reserved against user presets (file, store, CLI)."""

import json
import re

import pytest

from kvsieve.policies import parse_kv_policy
from kvsieve.service.presets import (BUILTIN_PRESETS, builtin_listing, builtin_presets, load_presets,
                                     usable_builtins, validate_presets)

# rkv-paper and skipkv-paper set R-KV's `scoring: "paper"` (another change
# adds the field): they validate once it is there.
NAMES = sorted(BUILTIN_PRESETS)


def settings_of(kv_policy: dict) -> set[str]:
    top = {k for k in kv_policy if k not in ("name", "params")}
    return top | {f"params.{k}" for k in kv_policy.get("params", {})}


@pytest.mark.parametrize("name", NAMES)
def test_each_builtin_validates_and_keeps_its_values(name):
    spec = parse_kv_policy(name, builtin_presets())
    assert spec.preset == name and spec.name == BUILTIN_PRESETS[name].kv_policy["name"]
    for key, value in BUILTIN_PRESETS[name].kv_policy.get("params", {}).items():
        assert spec.params[key] == (tuple(value) if isinstance(value, list) else value)


@pytest.mark.parametrize("name", NAMES)
def test_every_setting_names_its_source(name):
    preset = BUILTIN_PRESETS[name]
    assert settings_of(preset.kv_policy) <= set(preset.sources)
    for key, source in preset.sources.items():
        assert re.search(r"§\d|Table|Algorithm|slides|R-KV", source), (key, source)
    assert json.dumps(preset.listing())  # the listing is JSON


def test_the_papers_values():
    p = {name: BUILTIN_PRESETS[name].kv_policy for name in NAMES}
    assert p["rkv-paper"]["params"]["buffer"] == 128 and p["rkv-paper"]["params"]["scoring"] == "paper"
    assert p["skipkv-paper"]["params"]["scoring"] == "paper"
    assert p["thinkv-paper"]["params"] | {"budget": p["thinkv-paper"]["budget"]} == {
        "refresh": 128, "retention": [64, 32, 16, 8, 4], "tbq": True, "tbq_precision": "R4E4T2", "budget": 1024}
    crystal = p["crystal_kv-paper"]["params"]
    assert crystal["adaptive"] is True and crystal["evict_interval"] == 1 and crystal["answer_tokens"] is None
    assert crystal["top_p"] == 0.9 and 0.5 <= crystal["decay"] <= 0.7
    assert p["crystalcache-paper-b30"]["budget_ratio"] == 0.3 and p["crystalcache-paper-b50"]["budget_ratio"] == 0.5
    assert p["crystalcache-paper-b30"]["params"]["sinks"] + p["crystalcache-paper-b30"]["params"]["recent"] == 132
    assert p["longflow-paper"]["budget"] == 3200 and p["longflow-paper-2400"]["budget"] == 2400


def test_a_request_starts_from_a_builtin_and_overrides_it():
    spec = parse_kv_policy({"preset": "longflow-paper", "budget": 64, "params": {"window": 8}}, builtin_presets())
    assert spec.budget == 64 and spec.params["window"] == 8 and spec.params["kernel"] == 7
    assert spec.preset == "longflow-paper"
    ratio = parse_kv_policy({"preset": "thinkv-paper", "budget_ratio": 0.2}, builtin_presets())
    assert ratio.budget is None and ratio.budget_ratio == 0.2


def test_builtin_names_are_reserved_for_user_presets(tmp_path):
    with pytest.raises(ValueError, match="built-in preset"):
        validate_presets({"thinkv-paper": {"name": "h2o"}})  # the store's and the CLI's check
    path = tmp_path / "presets.json"
    path.write_text(json.dumps({"longflow-paper": {"name": "longflow", "budget": 64}}))
    with pytest.raises(ValueError, match="built-in preset"):
        load_presets(path)  # a presets file stops start-up


def test_loaded_presets_are_the_builtins_and_the_files(tmp_path):
    path = tmp_path / "presets.json"
    path.write_text(json.dumps({"mine": {"name": "h2o", "budget": 64}}))
    loaded = load_presets(path)
    assert loaded["mine"] == {"name": "h2o", "budget": 64}
    assert set(usable_builtins()) <= set(loaded) and set(load_presets(None)) == set(usable_builtins())


def test_the_listing_keeps_the_served_policies_presets():
    listing = builtin_listing({"thinkv", "longflow"})
    assert set(listing) == {"thinkv-paper", "longflow-paper", "longflow-paper-2400"}
    assert listing["thinkv-paper"]["sources"]["params.refresh"].startswith("§4.1")
