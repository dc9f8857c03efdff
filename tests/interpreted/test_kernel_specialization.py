"""A step's shapes never compile a new kernel mid-serving.

Triton compiles a kernel once per *specialization*: the values of its
constexpr arguments, and for every other integer whether it equals 1 and
whether 16 divides it (pointers: whether 16 bytes align them), unless the
kernel lists it in `do_not_specialize`. An argument that follows the step's
shapes (a page-table width, a prefix length, a stride of a scratch buffer
sized by them) flips those flags as requests come and go, and each flip is
a compile of seconds on a GPU while every request of the engine waits
(bench/results/traffic-layer-blocks-steps.jsonl: decode steps of 1-4 s
whenever a prefix or region width first reached a new class).

Here every kernel launch of the decode, extend and LongFlow passes over a
sweep of rows, widths, prefixes and chunk lengths is recorded, not run, and
its specialization key computed as Triton's JIT computes it
(`native_specialize_impl`, honouring do_not_specialize and
do_not_specialize_on_alignment). Per-row tensors come as the step builder
ships them: views into one buffer, at offsets that follow the row count
(`shipped`), so their pointers' 16-byte alignment changes with it (1.1 s
compiles under traffic on an H200, 2026-11-29). For each set of
constexpr values (a flag or a power-of-two tile class, fixed per kernel
variant) there must be exactly one key: the shapes then choose among a few
kernels compiled early, never a new one.

Run by tests/test_triton_kernels.py (TRITON_INTERPRET=1)."""

import inspect
import os
from collections import defaultdict

import pytest
import torch

from kvsieve.policies import Need

HQ, HKV, D, PAGE = 28, 4, 16, 16  # R1-Distill-Qwen-7B's heads (head_dim small: nothing runs)


@pytest.fixture
def launches(monkeypatch):
    """kernel name -> list of (constexpr values, specialization key) of every launch."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from kvsieve.kernels import decode_attention as da
    from kvsieve.kernels import extend_attention as ea
    from kvsieve.kernels import longflow_fused as lf
    from kvsieve.kernels import region_store as rs

    seen = defaultdict(list)

    def recorder(kernel):
        params = list(inspect.signature(kernel.fn).parameters.values())
        loose = set(kernel.kwargs.get("do_not_specialize") or ())
        unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())

        def run(*args, grid, warmup, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            values = dict(zip((p.name for p in params), args), **kwargs)
            constexprs, key = [], []
            for i, p in enumerate(params):
                value = values[p.name]
                if "constexpr" in str(p.annotation):
                    constexprs.append((p.name, value))
                else:
                    specialize = not (i in loose or p.name in loose)
                    align = not (i in unaligned or p.name in unaligned)
                    key.append((p.name, native_specialize_impl(BaseBackend, value, False, specialize, align)))
            seen[kernel.fn.__name__].append((tuple(constexprs) + tuple(sorted(options.items())), tuple(key)))

        return run

    for module in (da, ea, lf, rs):
        for name, obj in vars(module).items():
            if name.startswith("_") and hasattr(obj, "fn") and hasattr(obj, "kwargs"):
                monkeypatch.setattr(obj, "run", recorder(obj))
    return seen


def assert_one_key_per_variant(seen, kernels):
    for name in kernels:
        assert seen[name], f"{name} never launched"
        keys = defaultdict(set)
        for constexprs, key in seen[name]:
            keys[constexprs].add(key)
        for constexprs, found in keys.items():
            if len(found) > 1:
                common = set.intersection(*(set(k) for k in found))
                varying = sorted({n for k in found for n, spec in k if (n, spec) not in common})
                pytest.fail(f"{name}: {len(found)} compiles for one variant; arguments that follow the shapes: "
                            f"{varying}")


def shipped(*values: torch.Tensor, after: int | None = None) -> list[torch.Tensor]:
    """`values` (one dtype) as views into one buffer after `after` (default:
    one row list's) elements of other lists, as
    policies.observations.rows_to_device ships a step's per-row lists:
    where a view starts follows the row count."""
    before = len(values[0]) if after is None else after
    flat = torch.cat([torch.zeros(before, dtype=values[0].dtype), *values])
    return list(flat.split([before, *(len(v) for v in values)]))[1:]


def region(R, M, pages_extra=3):
    pages = R * HKV * M + pages_extra
    return dict(region_k=torch.zeros(pages + 1, PAGE, D, dtype=torch.float16),
                region_v=torch.zeros(pages + 1, PAGE, D, dtype=torch.float16),
                region_valid=torch.zeros(pages + 1, PAGE, dtype=torch.bool),
                table=torch.zeros(R, HKV, M, dtype=torch.int64))


def pool(P, R):
    return dict(pool_k=torch.zeros(64, HKV, D, dtype=torch.float16),
                pool_v=torch.zeros(64, HKV, D, dtype=torch.float16),
                prefix_slots=torch.zeros(R, P, dtype=torch.int64), prefix_len=shipped(torch.full((R,), P))[0])


# Widths as the step builder makes them (page-table columns rounded to 4; past
# 128 four steps per doubling), prefixes as the prefix tables and radix
# prefixes bring them (0, multiples of 128, a prompt's own length).
WIDTHS = (4, 8, 12, 16, 20, 36, 52, 92, 128, 320)
PREFIXES = (0, 128, 240, 301, 384)


@pytest.mark.parametrize("needs", [Need.NONE, Need.ATTENTION, Need.ATTENTION | Need.PV_NORM,
                                   Need.ATTENTION | Need.PV_NORM | Need.SPARSITY])
def test_the_decode_pass_compiles_once_per_variant_whatever_the_widths(launches, needs):
    from kvsieve.kernels.decode_attention import decode_attention

    for R in (1, 3, 16):
        for M in WIDTHS:
            for P in PREFIXES:
                columns, observe = shipped(torch.full((R,), M, dtype=torch.int32), torch.ones(R, dtype=torch.int32))
                decode_attention(torch.zeros(R, HQ, D, dtype=torch.float16), **pool(P, R), **region(R, M),
                                 scale=0.25, needs=needs, fused=False, row_columns=columns, row_observe=observe)
    assert_one_key_per_variant(launches, ["_partial_kernel", "_merge_kernel"]
                               + (["_observe_kernel"] if needs else []))


def test_the_extend_pass_compiles_once_per_variant_whatever_the_chunks(launches):
    from kvsieve.kernels.extend_attention import extend_attention

    for R in (1, 3):
        for T in (1, 5, 16, 33, 512):
            for M in (4, 12, 37):
                for P in PREFIXES:
                    for observe in (None, torch.ones(R, T, dtype=torch.bool)):
                        extend_attention(torch.zeros(R, T, HQ, D, dtype=torch.float16),
                                         torch.zeros(R, T, dtype=torch.int64), **pool(P, R), **region(R, M),
                                         region_position=torch.zeros(R * HKV * M + 4, PAGE, dtype=torch.int64),
                                         scale=0.25, observe=observe)
    assert_one_key_per_variant(launches, ["_extend_kernel", "_observe_kernel"])


def test_longflows_fused_pass_compiles_once_per_tile_class(launches):
    from kvsieve.kernels import longflow_fused as lf

    for R in (1, 3, 16):
        for M in [m for m in WIDTHS if m * PAGE <= lf.MAX_SLOTS]:  # wider regions take the split-KV pass
            for P in PREFIXES:
                case = dict(**pool(P, R), **region(R, M))
                # The step's prefix lengths are its third list of int64 rows
                # (step_meta._region_rows): 16R bytes in, always 16-aligned,
                # as this kernel needs (it passes them as a placeholder for
                # Victim, which it specializes on alignment).
                case["prefix_len"] = shipped(torch.full((R,), P), after=2 * R)[0]
                case["region_vnorm"] = torch.zeros(case["region_k"].shape[:2])
                q = torch.zeros(R, HQ, D, dtype=torch.float16)
                lf.decode_attention_observed(q, **case, scale=0.25, needs=Need.PV_NORM)
                lf.longflow_decode(q, **case, scale=0.25,
                                   region_position=torch.zeros(case["region_k"].shape[:2], dtype=torch.int64))
                S = M * PAGE
                lf.longflow_select(torch.zeros(R, HKV, S), torch.zeros(R, S, dtype=torch.bool),
                                   torch.zeros(R, S, dtype=torch.int64), protect=shipped(torch.ones(R, dtype=torch.int32))[0])
    assert_one_key_per_variant(launches, ["_fused_kernel", "_select_kernel"])


def test_the_store_compiles_once_whatever_the_rows(launches):
    from kvsieve.kernels import region_store

    for R in (1, 3, 5, 16, 33):
        for M in WIDTHS:
            pages = R * HKV * M
            batch_index, positions, pool_rows = shipped(torch.arange(R), torch.arange(R) + 100, torch.arange(R) + 1)
            row_columns = shipped(torch.full((R,), M, dtype=torch.int32))[0]
            qkv = torch.zeros(R, 3 * HKV, D, dtype=torch.float16)
            region_store.store_new_tokens(
                torch.zeros(R, HKV, M, dtype=torch.int64), batch_index, positions, pool_rows,
                qkv[:, HKV:2 * HKV], qkv[:, 2 * HKV:], torch.zeros(pages + 1, PAGE, D, dtype=torch.float16),
                torch.zeros(pages + 1, PAGE, D, dtype=torch.float16), torch.zeros(pages + 1, PAGE, dtype=torch.bool),
                torch.zeros(pages + 1, PAGE), torch.zeros(pages + 1, PAGE, dtype=torch.int64),
                torch.zeros(pages + 1, PAGE), torch.zeros(pages + 1, PAGE, dtype=torch.int32),
                torch.zeros(2 * R + 2, dtype=torch.bool), pages, row_columns=row_columns)
    assert_one_key_per_variant(launches, ["_store_kernel"])
