"""The store of a decode step's new tokens (kernels/region_store.py) against
its PyTorch form, bit for bit (|v|_1 to fp32 rounding), on CPU through Triton's interpreter: free
slots found anywhere in a row, heads and rows with none free (overflow),
quantized pages (ids past the null page) that never offer a slot, padded
rows of only the null page, a narrower region dtype and strided K/V.

Run by tests/test_triton_kernels.py in a process of its own with
TRITON_INTERPRET=1."""

import os

import pytest
import torch

from helpers.region_store_case import assert_kernel_writes_what_the_reference_writes, region_case, run_store


@pytest.fixture(scope="module")
def store():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"
    from kvsieve.kernels import region_store

    return region_store


@pytest.mark.parametrize("R, H, M, P, D, padded, quantized, seed, own_columns", [
    (6, 4, 5, 16, 128, 0, 0, 0, False),
    (5, 2, 23, 16, 64, 3, 0, 1, False),   # wider than one block of slots; padded rows
    (4, 4, 6, 8, 96, 2, 4, 2, False),     # TBQ: only the first columns are full precision; D not a power of two
    (9, 2, 23, 16, 64, 2, 0, 4, True),    # rows narrower than the table (a mixed batch's)
])
def test_the_kernel_writes_what_the_pytorch_store_writes(store, R, H, M, P, D, padded, quantized, seed, own_columns):
    case = region_case(R, H, M, P, D, seed, padded=padded, quantized_columns=quantized, own_columns=own_columns)
    assert_kernel_writes_what_the_reference_writes(store, case)


def test_a_row_takes_no_slot_past_its_own_columns(store):
    case = region_case(3, 2, 4, 16, 32, seed=5)
    table, valid = case["table"], case["valid"]
    # Row 2 holds two columns, both full; its table's columns 2-3 hold pages with free slots.
    valid[table[2, :, :2]] = True
    valid[table[2, :, 2:]] = False
    case["row_columns"] = torch.tensor([4, 4, 2], dtype=torch.int32)
    got = run_store(store.store_new_tokens, case)
    assert not got["valid"][table[2, :, 2:]].any()
    assert got["overflow_flags"][case["pool_rows"][2]]


def test_a_row_takes_the_lowest_free_slot_of_each_head(store):
    case = region_case(3, 2, 4, 16, 32, seed=3)
    table, valid = case["table"], case["valid"]
    # Row 2, head 1: every slot taken but slot 5 of column 2 and slot 9 of column 3.
    valid[table[2, 1]] = True
    valid[table[2, 1, 2], 5] = False
    valid[table[2, 1, 3], 9] = False
    got = run_store(store.store_new_tokens, case)
    page = table[2, 1, 2]
    assert got["valid"][page, 5] and not got["valid"][table[2, 1, 3], 9]
    assert got["position"][page, 5] == case["positions"][2]
    assert torch.equal(got["region_k"][page, 5], case["k"][case["batch_index"][2], 1].to(torch.float16))
    assert got["score"][page, 5] == 0 and got["last_hit"][page, 5] == 0
