"""The KVSIEVE_* on/off switches share one parser (kvsieve/env_flags.py):
"1" on, "0" off, unset the default, anything else an error naming the
variable (a typo never reads as "off")."""

import pytest

from kvsieve.env_flags import flag
from kvsieve.kernels import region_store
from kvsieve.radix_ext import forward_graphs, kernel_warmup, region_graphs

SWITCHES = [
    ("KVSIEVE_DEFER_GROUPS", region_graphs.defer_enabled),
    ("KVSIEVE_EAGER_DEFER", region_graphs.eager_defer_enabled),
    ("KVSIEVE_CAPTURE_FIRST_SIGHT", region_graphs.first_sight_enabled),
    ("KVSIEVE_GRAPH_BUCKETS", region_graphs.buckets_enabled),
    ("KVSIEVE_FORWARD_GRAPHS", forward_graphs.enabled),
    ("KVSIEVE_FOLD_POOL_ROWS", forward_graphs.folds_pool_rows),
    ("KVSIEVE_KERNEL_WARMUP", kernel_warmup.enabled),
    ("KVSIEVE_FUSED_STORE", region_store.enabled),
]


@pytest.mark.parametrize("name,read", SWITCHES)
def test_each_switch_is_on_by_default_and_reads_zero_and_one(monkeypatch, name, read):
    monkeypatch.delenv(name, raising=False)
    assert read() is True
    monkeypatch.setenv(name, "0")
    assert read() is False
    monkeypatch.setenv(name, "1")
    assert read() is True


@pytest.mark.parametrize("name,read", SWITCHES)
def test_a_typo_is_an_error_naming_the_switch(monkeypatch, name, read):
    monkeypatch.setenv(name, "off")
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, not 'off'"):
        read()


def test_an_unset_switch_takes_its_default(monkeypatch):
    monkeypatch.delenv("KVSIEVE_TEST_SWITCH", raising=False)
    assert flag("KVSIEVE_TEST_SWITCH", default=False) is False
    monkeypatch.setenv("KVSIEVE_TEST_SWITCH", "")
    with pytest.raises(ValueError, match="KVSIEVE_TEST_SWITCH"):
        flag("KVSIEVE_TEST_SWITCH")
