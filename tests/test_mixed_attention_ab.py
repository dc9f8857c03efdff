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
    assert needs == Need.ATTENTION | Need.PV_NORM | Need.SPARSITY
    cols, bits = step["row_columns"].tolist(), step["row_observe"].tolist()
    # 20 rows of eight classes: the first four get three, the rest two, in class order
    assert cols == [20] * 14 + [36] * 2 + [20] * 2 + [24] * 2
    assert bits[:3] == [observe_bits_of(Need.ATTENTION)] * 3
    assert [bool(b & OBSERVE_PV) for b in bits] == [False] * 16 + [True] * 2 + [False] * 2
    null = step["region_k"].shape[0] - 1
    table = step["table"]
    for r, c in enumerate(cols):
        assert (table[r, :, c:] == null).all() and (table[r, :, :c] < null).all()
    assert step["prefix_slots"].shape == (20, ab.PREFIX_WIDTH) and (step["prefix_len"] == ab.PROMPT).all()
