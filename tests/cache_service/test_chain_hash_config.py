"""chain_hash takes its settings as parameters (the service's --cache-native / --kernel-cache),
never from the environment."""
from __future__ import annotations

import pytest

from cache_service import chain_hash


@pytest.fixture
def restore():
    yield
    chain_hash.configure()  # the defaults: auto, the default kernel cache


def test_configure_off_hashes_through_hashlib_whatever_the_environment(monkeypatch,
                                                                       restore) -> None:
    monkeypatch.setenv("PREFIXCACHE_CACHE_NATIVE", "on")  # ignored: the service reads it
    chain_hash.configure("off")
    assert chain_hash.chain_function() is chain_hash.python_chain and not chain_hash.is_native()


def test_a_bad_mode_is_refused(restore) -> None:
    with pytest.raises(ValueError, match="expected auto, on or off"):
        chain_hash.configure("sometimes")


def test_the_kernel_cache_is_a_parameter(tmp_path, restore) -> None:
    chain_hash.configure("auto", tmp_path / "k")
    assert chain_hash._cache_dir() == tmp_path / "k"
