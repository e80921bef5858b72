"""Issue 25 finding 9: the cache and compute services listened on every interface by default
(`[::]:PORT`), and the hand-started commands of the READMEs run them without service
authentication, so anyone on the network could call every RPC (register pools, read event
streams, Generate, load adapters).

Now both bind loopback by default, and a non-loopback --host without --service-identities-file
is refused at start (exit 2, naming --allow-unauthenticated-network) unless that flag, or its
variable, says so. The manifests set PREFIXCACHE_{CACHE,COMPUTE}_HOST=[::] and mount identities
(tests/deploy)."""
from __future__ import annotations

import pytest

from cache_service import __main__ as cache_main
from cache_service.server import ServerConfig as CacheConfig
from compute_service import __main__ as compute_main
from compute_service.server import ServerConfig as ComputeConfig
from service_shell.auth_flags import is_loopback
from tests.security.harness import write_identities

SERVICES = {
    "cache": (cache_main.parse_args, []),
    "compute": (compute_main.parse_args, ["--model", "tiny-transformer"]),
}
FLAG = "--allow-unauthenticated-network"


@pytest.mark.parametrize("service", SERVICES)
def test_by_default_a_service_binds_loopback_only(service, monkeypatch):
    monkeypatch.delenv(f"PREFIXCACHE_{service.upper()}_HOST", raising=False)
    parse, base = SERVICES[service]
    args = parse(base)
    assert args.host == "127.0.0.1" and args.auth is None
    assert CacheConfig().host == ComputeConfig().host == "127.0.0.1"


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize("host", ["[::]", "0.0.0.0", "10.1.2.3", "worker.example"],
                         ids=["any-v6", "any-v4", "private-ip", "a-name"])
def test_attack_an_unauthenticated_service_on_the_network(service, host, capsys, monkeypatch):
    """A service started to listen beyond loopback with auth off: refused at start, and the
    message names the flag that would allow it."""
    monkeypatch.delenv("PREFIXCACHE_ALLOW_UNAUTHENTICATED_NETWORK", raising=False)
    parse, base = SERVICES[service]
    with pytest.raises(SystemExit) as exit_:
        parse([*base, "--host", host])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--host {host}: not a loopback address" in err and FLAG in err
    assert "PREFIXCACHE_ALLOW_UNAUTHENTICATED_NETWORK" in err


@pytest.mark.parametrize("service", SERVICES)
def test_identities_or_the_explicit_flag_allow_a_network_address(service, tmp_path, monkeypatch):
    parse, base = SERVICES[service]
    ids = write_identities(tmp_path)
    assert parse([*base, "--host", "[::]", "--service-identities-file", str(ids)]).auth
    assert parse([*base, "--host", "[::]", FLAG]).host == "[::]"
    monkeypatch.setenv("PREFIXCACHE_ALLOW_UNAUTHENTICATED_NETWORK", "1")
    assert parse([*base, "--host", "0.0.0.0"]).host == "0.0.0.0"
    for host in ("127.0.0.1", "[::1]", "localhost", "127.0.0.2"):  # loopback needs nothing
        monkeypatch.delenv("PREFIXCACHE_ALLOW_UNAUTHENTICATED_NETWORK")
        assert parse([*base, "--host", host]).host == host
        monkeypatch.setenv("PREFIXCACHE_ALLOW_UNAUTHENTICATED_NETWORK", "1")


def test_loopback_is_an_address_of_this_machine_only():
    assert all(map(is_loopback, ["127.0.0.1", "[::1]", "::1", "localhost"]))
    assert not any(map(is_loopback, ["[::]", "0.0.0.0", "10.0.0.1", "example.com", ""]))
