"""kv_policy parsing and validation (no engine)."""

import pytest

from kvsieve.policies import KVPolicyError, parse_kv_policy, policy_names


def test_none_means_full():
    spec = parse_kv_policy(None)
    assert spec.name == "full" and not spec.compresses


def test_name_string_and_object_give_same_spec():
    assert parse_kv_policy("full") == parse_kv_policy({"name": "full"})
    assert parse_kv_policy({"name": "full", "params": {}}).to_custom_params() == {"name": "full", "params": {}}


def test_preset_resolves_and_is_reported():
    spec = parse_kv_policy("lossless", presets={"lossless": {"name": "full"}})
    assert spec.name == "full" and spec.preset == "lossless"


@pytest.mark.parametrize(
    "value, field, words",
    [
        ("nope", "kv_policy.name", "unknown policy"),
        ({"name": "nope"}, "kv_policy.name", "unknown policy"),
        ({"budget": 4}, "kv_policy.name", "required"),
        ({"name": 3}, "kv_policy.name", "string"),
        ({"name": "full", "budget": 0}, "kv_policy.budget", "greater than 0"),
        ({"name": "full", "budget": -5}, "kv_policy.budget", "greater than 0"),
        ({"name": "full", "budget": "many"}, "kv_policy.budget", "integer"),
        ({"name": "full", "budget_ratio": 1.5}, "kv_policy.budget_ratio", "less than or equal"),
        ({"name": "full", "budget": 8, "budget_ratio": 0.5}, "kv_policy.budget_ratio", "not both"),
        ({"name": "full", "budget": 8}, "kv_policy.budget", "takes no budget"),
        ({"name": "full", "params": {"decay": 0.5}}, "kv_policy.params.decay", "unknown field"),
        ({"name": "full", "colour": "red"}, "kv_policy.colour", "unknown field"),
        ({"name": "full", "params": [1]}, "kv_policy.params", "dictionary"),
        (42, "kv_policy", "policy or preset name"),
    ],
)
def test_invalid_values_name_the_field(value, field, words):
    with pytest.raises(KVPolicyError) as info:
        parse_kv_policy(value)
    assert info.value.field == field
    assert words in info.value.message


def test_registry_lists_full():
    assert "full" in policy_names()


def test_a_policy_the_engine_does_not_serve_is_refused_by_name():
    # On GPU only `full` is served until the Triton path exists: a compressing
    # policy must be refused, never run as `full`.
    with pytest.raises(KVPolicyError) as info:
        parse_kv_policy({"name": "h2o", "budget": 64}, served={"full"})
    assert info.value.field == "kv_policy.name"
    assert "not served by this engine" in info.value.message
    assert parse_kv_policy({"name": "h2o", "budget": 64}, served={"full", "h2o"}).name == "h2o"
