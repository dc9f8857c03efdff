"""bench/mixed_attention_ab.py's synthetic step (the timing itself needs a GPU)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import mixed_attention_ab as ab  # noqa: E402

from kvsieve.policies import Need  # noqa: E402
from kvsieve.radix_ext.step_meta import OBSERVE_PV, observe_bits_of  # noqa: E402


def test_rows_are_dealt_to_classes_with_their_own_columns_and_observation_bits():
    step, needs = ab.make_step(ab.CLASSES, 20, torch.device("cpu"), torch.float32)
    # The union of the rows' needs past the first layer, as the engine passes it
    # (keys and token ids keep the split-KV path; CrystalCache observes layer 0 only).
    assert needs & (Need.ATTENTION | Need.PV_NORM | Need.SPARSITY) == Need.ATTENTION | Need.PV_NORM | Need.SPARSITY
    assert needs & Need.KEYS and not needs & Need.LAYER0_ATTENTION
    cols, bits = step["row_columns"].tolist(), step["row_observe"].tolist()
    # 20 rows of eight classes: the first four get three, the rest two, in class order
    assert cols == [20] * 14 + [36] * 2 + [20] * 2 + [24] * 2
    assert bits[:3] == [observe_bits_of(Need.ATTENTION)] * 3 and bits[-1] == 0  # crystalcache: layer 0 only
    assert [bool(b & OBSERVE_PV) for b in bits] == [False] * 16 + [True] * 2 + [False] * 2
    null = step["region_k"].shape[0] - 1
    table = step["table"]
    for r, c in enumerate(cols):
        assert (table[r, :, c:] == null).all() and (table[r, :, :c] < null).all()
    assert step["prefix_slots"].shape == (20, ab.PREFIX_WIDTH) and (step["prefix_len"] == ab.PROMPT).all()


def test_a_longflow_only_step_takes_the_fused_kernel_and_a_mix_does_not():
    """The engine's routing (longflow_fused.applies on the step's needs)."""
    from kvsieve.kernels import longflow_fused

    _, alone = ab.make_step([("longflow", 20)], 4, torch.device("cpu"), torch.float32)
    _, mixed = ab.make_step(ab.CLASSES, 16, torch.device("cpu"), torch.float32)
    slots = 20 * ab.PAGE
    assert longflow_fused.applies(alone, None, slots) == longflow_fused.enabled()
    assert not longflow_fused.applies(mixed, None, slots)


def test_a_longflow_step_at_budget_1024_is_within_the_fused_kernels_width():
    """LongFlow rows alone at budget 1024 hold 1,025 slots a head (65 columns
    of 16), and a step pads its table to step_width_bucket's 80 columns: the
    fused pass has to take that width, or every such step goes the split
    path with its scratch and observation kernel (3.2 ms of a 600-row step
    on an H200 when it did, 2026-12-03)."""
    from kvsieve.kernels import longflow_fused
    from kvsieve.radix_ext.step_meta import step_width_bucket

    columns = -(-(1024 + 1) // ab.PAGE)
    _, alone = ab.make_step([("longflow", columns)], 4, torch.device("cpu"), torch.float32)
    width = step_width_bucket(columns)
    assert (columns, width) == (65, 80)
    assert longflow_fused.applies(alone, None, width * ab.PAGE) == longflow_fused.enabled()
