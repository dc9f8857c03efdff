"""radix_ext/byte_pack.py: small tensors of mixed dtypes through one buffer
of bytes (a step's policy groups shipped in one transfer, a captured
segment's static inputs refilled by one copy)."""

import torch

from kvsieve.radix_ext import byte_pack


def mixed():
    # Narrow before wide, empty, 2-D and 3-D: the layout must realign them.
    return [torch.tensor([True, False, True]), torch.arange(5, dtype=torch.int64) * 7,
            torch.tensor([[1.5, -2.0], [3.25, 0.0]]), torch.zeros((3, 0), dtype=torch.int64),
            torch.arange(24, dtype=torch.int32).view(2, 3, 4), torch.tensor([9], dtype=torch.int64),
            torch.tensor([0.5], dtype=torch.float16)]


def test_pack_gives_views_of_one_buffer_equal_to_the_tensors():
    tensors = mixed()
    flat, views = byte_pack.pack(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for t in tensors)
    for t, v in zip(tensors, views):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
        if v.numel():
            start = v.data_ptr() - flat.data_ptr()
            assert 0 <= start < flat.numel() and start % t.element_size() == 0  # aligned in the buffer
    flat.zero_()  # the views are the buffer
    assert not views[1].any() and not views[0].any()


def test_refill_writes_new_values_through_the_same_views():
    flat, views = byte_pack.pack(mixed())
    fresh = [t.clone() for t in mixed()]
    fresh[1] += 100
    fresh[0] = ~fresh[0]
    fresh[2] = fresh[2] * -1
    byte_pack.refill(flat, fresh)
    for t, v in zip(fresh, views):
        assert torch.equal(v, t)


def test_to_device_ships_lists_whose_bytes_refill_a_packed_copy():
    first, second = mixed(), [torch.tensor([3, 4], dtype=torch.int64), torch.tensor([True])]
    (got_first, bytes_first), (got_second, bytes_second) = byte_pack.to_device([first, second], "cpu")
    for t, v in zip(first + second, got_first + got_second):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
    # Each list starts aligned in the shipped buffer, and its bytes are
    # laid out as pack lays out tensors of those shapes: one copy refills.
    assert (got_second[0].data_ptr() - got_first[1].data_ptr()) % byte_pack.ALIGN == 0
    flat, views = byte_pack.pack([torch.zeros_like(t) for t in first])
    flat.copy_(bytes_first)
    assert all(torch.equal(v, t) for v, t in zip(views, first))
    assert bytes_second.numel() == 2 * 8 + 1
