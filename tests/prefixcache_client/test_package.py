"""The package's public names: each one loads on first use and is its module's own object."""
import importlib

import pytest

import prefixcache_client


@pytest.mark.parametrize("name", prefixcache_client.__all__)
def test_every_public_name_is_its_modules_object(name):
    value = getattr(prefixcache_client, name)
    module = importlib.import_module(f"prefixcache_client.{prefixcache_client._MODULE_OF[name]}")
    assert value is getattr(module, name)
    assert name in dir(prefixcache_client)


def test_all_lists_every_lazy_name_once():
    assert sorted(prefixcache_client.__all__) == sorted(set(prefixcache_client._MODULE_OF))


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        prefixcache_client.no_such_name  # noqa: B018


def test_a_rejected_call_is_a_cache_error():
    from prefixcache_client import CacheError, CacheRejectedError
    assert issubclass(CacheRejectedError, CacheError)
