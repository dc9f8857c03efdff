"""thinkv's per-request overrides of the calibration artifact (issue #30:
`thresholds`, `layers`, ThinKV §4.1) and TBQ's precision without a silent
downgrade (`tbq_precision` R8E4T2 needs KVSIEVE_TBQ_BITS=8; kv_usage reports
what each thought type got)."""

import pytest
import torch

from kvsieve.kernels import kv_formats as kvf
from kvsieve.policies import KVPolicyError, Observations, PolicyBatch, get_policy, parse_kv_policy
from kvsieve.policies.base import ModelInfo, StepRow
from kvsieve.policies.thinkv.calibration import Calibration, fallback, overridden
from kvsieve.policies.thinkv.policy import TBQ_BITS_ENV, ThinKVParams
from kvsieve.policies.thinkv.segments import Thought

R_, E_, T_ = Thought.REASONING, Thought.EXECUTION, Thought.TRANSITION
LAYERS = 3
#: Sparsity of each layer at every step: layer 0 (the calibrated L*) 0.6, layer 2 0.2.
LAYER_SPARSITY = {0: 0.6, 1: 0.9, 2: 0.2}


def bad_params(params: dict) -> str:
    with pytest.raises(KVPolicyError) as err:
        parse_kv_policy({"name": "thinkv", "params": params})
    return err.value.field


def test_threshold_and_layer_bounds_name_the_field():
    assert bad_params({"thresholds": [0.6, 0.3]}) == "kv_policy.params.thresholds"  # theta_1 < theta_2
    assert bad_params({"thresholds": [0.3, 0.3]}) == "kv_policy.params.thresholds"
    assert bad_params({"thresholds": [-0.1, 0.3]}) == "kv_policy.params.thresholds.0"
    assert bad_params({"thresholds": [0.1, 1.5]}) == "kv_policy.params.thresholds.1"
    assert bad_params({"thresholds": [0.1]}) == "kv_policy.params.thresholds.1"  # missing
    assert bad_params({"thresholds": [True, 0.5]}) == "kv_policy.params.thresholds.0"
    assert bad_params({"thresholds": ["0.1", 0.5]}) == "kv_policy.params.thresholds.0"
    assert bad_params({"layers": []}) == "kv_policy.params.layers"
    assert bad_params({"layers": [1, 1]}) == "kv_policy.params.layers"
    assert bad_params({"layers": [-1]}) == "kv_policy.params.layers.0"
    assert bad_params({"layers": [4096]}) == "kv_policy.params.layers.0"
    assert bad_params({"layers": ["1"]}) == "kv_policy.params.layers.0"
    assert bad_params({"layers": list(range(65))}) == "kv_policy.params.layers"
    ok = parse_kv_policy({"name": "thinkv", "params": {"thresholds": [0, 1], "layers": [3, 1]}}).params
    assert ok["thresholds"] == (0.0, 1.0) and ok["layers"] == (3, 1)


def test_overrides_replace_the_artifacts_parts_and_a_full_override_uses_no_fallback():
    base = fallback("m", 12, "uncalibrated")
    assert overridden(base, 12) is base
    layers_only = overridden(base, 12, layers=(5, 1))
    assert layers_only.layers == (1, 5) and layers_only.thresholds == base.thresholds
    assert layers_only.fallback == "uncalibrated" and layers_only.overrides == ("layers",)
    both = overridden(base, 12, layers=(2,), thresholds=(0.2, 0.4))
    assert both.fallback is None and both.thresholds == (0.2, 0.4) and both.overrides == ("layers", "thresholds")
    with pytest.raises(ValueError, match="past the model's 12 layers"):
        overridden(base, 12, layers=(12,))


def new_policy():
    policy = get_policy("thinkv")()
    policy.use_calibration(Calibration(model="t", layers=(0,), thresholds=(0.45, 0.75)))
    policy.model = ModelInfo(name="t", num_layers=LAYERS, num_kv_heads=1, num_q_heads=2, head_dim=16)
    return policy


def test_a_layer_past_the_model_is_a_400_naming_layers():
    policy = new_policy()
    with pytest.raises(KVPolicyError) as err:
        policy.begin_request(ThinKVParams(layers=(3,)), LAYERS, 1)
    assert err.value.field == "kv_policy.params.layers"


def type_first_segments(params: list[dict]) -> tuple:
    """Decode steps 0..3 (refresh 4) of one row per params, every layer's
    sparsity LAYER_SPARSITY; segment 0 is typed at step 2. Returns the
    policy, the states and each step's input names."""
    policy = new_policy()
    cls = type(policy)
    rows = [ThinKVParams(refresh=4, **p) for p in params]
    tensors, maxima = cls.batch_params(rows)
    states = [policy.begin_request(p, LAYERS, 1) for p in rows]
    R = len(rows)
    names = []
    for t in range(4):
        step_rows = [StepRow(state=s, step=t, pool_row=r, budget=100, prefill=False, private_tokens=t + 1)
                     for r, s in enumerate(states)]
        inputs = policy.step_inputs(step_rows, "cpu")
        names.append(set(inputs))
        for layer in range(LAYERS):
            batch = PolicyBatch(layer=layer, budget=torch.full((R, 1), 100), step=torch.full((R,), t),
                                params=tensors, maxima=maxima, inputs=inputs, pool_rows=torch.arange(R),
                                max_rows=R)
            sparsity = torch.full((R, 2), LAYER_SPARSITY[layer])
            assert policy.select_decode(batch, None, Observations(sparsity=sparsity)) is None
    return policy, states, names


def test_each_row_types_its_segments_with_its_own_layers_and_thresholds():
    policy, states, names = type_first_segments([
        {},  # the calibration: layer 0 (0.6) between 0.45 and 0.75 -> R
        {"thresholds": [0.1, 0.5]},  # layer 0's 0.6 >= 0.5 -> T
        {"layers": [2]},  # layer 2 (0.2) < 0.45 -> E
        {"layers": [0, 2], "thresholds": [0.3, 0.5]},  # mean 0.4 in [0.3, 0.5) -> R
        {"layers": [1, 2], "thresholds": [0.1, 0.5]},  # mean 0.55 >= 0.5 -> T
    ])
    assert [s.book.segments[0].thought for s in states] == [R_, T_, E_, R_, T_]
    assert all("sparsity_layers" in n for n in names)
    # Without a row of its own layers the group records L* alone, as before.
    _, plain, names = type_first_segments([{}, {"thresholds": [0.1, 0.5]}])
    assert [s.book.segments[0].thought for s in plain] == [R_, T_]
    assert not any("sparsity_layers" in n for n in names)


def test_r8e4t2_needs_a_server_with_8_bit_rows(monkeypatch):
    monkeypatch.delenv(TBQ_BITS_ENV, raising=False)
    with pytest.raises(KVPolicyError) as err:
        parse_kv_policy({"name": "thinkv", "params": {"tbq_precision": "R8E4T2"}})
    assert err.value.field == "kv_policy.params.tbq_precision" and TBQ_BITS_ENV in err.value.message
    # Nothing is quantized without TBQ: nothing to refuse.
    assert parse_kv_policy({"name": "thinkv", "params": {"tbq": False, "tbq_precision": "R8E4T2"}})
    monkeypatch.setenv(TBQ_BITS_ENV, "8")
    spec = parse_kv_policy({"name": "thinkv", "params": {"tbq_precision": "R8E4T2"}})
    assert spec.params["tbq_precision"] == "R8E4T2"


@pytest.mark.parametrize("bits, precision, expected", [
    ("4", "R4E4T2", {"reasoning": "nvfp4", "execution": "nvfp4", "transition": "ternary"}),
    ("8", "R4E4T2", {"reasoning": "nvfp4", "execution": "nvfp4", "transition": "ternary"}),
    ("8", "R8E4T2", {"reasoning": "fp8", "execution": "nvfp4", "transition": "ternary"}),
])
def test_usage_reports_the_format_each_thought_types_groups_got(monkeypatch, bits, precision, expected):
    monkeypatch.setenv(TBQ_BITS_ENV, bits)
    rows = [{"tbq_precision": precision}, {"tbq_precision": precision, "thresholds": [0.1, 0.5]},
            {"tbq_precision": precision, "layers": [2]}]
    policy, states, _ = type_first_segments(rows)  # segment 0: R, T, E
    formats = [policy.group_format(s, 0) for s in states]
    names = {kvf.FP8: "fp8", kvf.NVFP4: "nvfp4", kvf.TERNARY: "ternary"}
    assert [names[f] for f in formats] == [expected["reasoning"], expected["transition"], expected["execution"]]
    usage = [policy.usage(s) for s in states]
    assert usage[0]["tbq_precision"] == {"reasoning": expected["reasoning"], "execution": "full",
                                         "transition": "full"}
    assert usage[1]["tbq_groups"] == {"reasoning": 0, "execution": 0, "transition": 1}
    assert usage[2]["thought_typing"] == {"layers": [2], "thresholds": [0.45, 0.75], "source": "artifact",
                                          "overrides": ["layers"]}


def test_usage_without_quantized_groups_reports_full_precision():
    policy, states, _ = type_first_segments([{"tbq": False}])
    assert policy.usage(states[0])["tbq_precision"] == {"reasoning": "full", "execution": "full",
                                                        "transition": "full"}
