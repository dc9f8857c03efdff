"""The pool/region split: the carve on CUDA and the errors that name the setting."""

from types import SimpleNamespace

import pytest

from kvsieve.radix_ext import memory_split


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("KVSIEVE_REGION_FRACTION", "KVSIEVE_REGION_PAGES", "KVSIEVE_REGION_SHARE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(memory_split, "carved_bytes", None)


def configurator(backend="kvsieve", device="cuda"):
    return SimpleNamespace(server_args=SimpleNamespace(attention_backend=backend, device=device))


def test_the_region_takes_its_fraction_of_sglangs_kv_budget(monkeypatch):
    monkeypatch.setenv("KVSIEVE_REGION_FRACTION", "0.25")
    pool_bytes = memory_split.carve_region(lambda c, pre: 1000, configurator(), 0)
    assert pool_bytes == 750 and memory_split.carved_bytes == 250
    assert memory_split.region_pages(pool_tokens=8192, num_layers=2, num_kv_heads=2, page_size=16,
                                     bytes_per_page=10) == 25


@pytest.mark.parametrize("backend, device", [("triton", "cuda"), ("kvsieve", "cpu")])
def test_other_backends_and_the_cpu_keep_sglangs_budget(backend, device):
    assert memory_split.carve_region(lambda c, pre: 1000, configurator(backend, device), 0) == 1000
    assert memory_split.carved_bytes is None


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.1", "half"])
def test_a_fraction_outside_0_1_fails_naming_the_setting(monkeypatch, value):
    monkeypatch.setenv("KVSIEVE_REGION_FRACTION", value)
    with pytest.raises(ValueError, match="KVSIEVE_REGION_FRACTION"):
        memory_split.carve_region(lambda c, pre: 1000, configurator(), 0)


def test_a_split_that_cannot_serve_fails_at_start_up_naming_the_setting(monkeypatch):
    monkeypatch.setenv("KVSIEVE_REGION_FRACTION", "0.99")
    memory_split.carve_region(lambda c, pre: 10**9, configurator(), 0)
    with pytest.raises(ValueError, match="KVSIEVE_REGION_FRACTION.*token pool 100 tokens"):
        memory_split.region_pages(pool_tokens=100, num_layers=2, num_kv_heads=2, page_size=16,
                                  bytes_per_page=64, context_len=32768)
    monkeypatch.setenv("KVSIEVE_REGION_PAGES", "3")
    with pytest.raises(ValueError, match="KVSIEVE_REGION_PAGES.*3 pages"):
        memory_split.region_pages(pool_tokens=100, num_layers=2, num_kv_heads=2, page_size=16, bytes_per_page=64)


def test_on_cpu_the_region_is_a_share_of_the_pool(monkeypatch):
    monkeypatch.setenv("KVSIEVE_REGION_SHARE", "0.5")
    assert memory_split.region_pages(pool_tokens=256, num_layers=2, num_kv_heads=2, page_size=16,
                                     bytes_per_page=64) == 32
