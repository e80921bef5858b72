"""The shared index's Redis behind an ACL password and mutual TLS (gateway/core/index_redis.py),
on a real redis-server that listens on a TLS port only, with the `default` user off: the
gateway's --index-redis-* flags reach a gateway whose indexer writes a real cache service's events
and whose router reads them; without the password, without the CA or without a client
certificate nothing connects; inconsistent flags are usage errors."""
from __future__ import annotations

import pytest
import redis

from gateway.__main__ import config_from_args, parse_args
from gateway.core.discovery import WorkerAddress
from gateway.core.shared_index import SharedIndexConfig, SharedIndexStore
from prefixcache_bench.local_redis import start_redis
from tests.cache_service.grpc_harness import running_server
from tests.gateway.gateway_harness import (Caller, FakeWorker, cache_prompt, register_pool,
                                           running_gateway, wait_until)
from tests.gateway.server_helpers import preview, prompt
from tests.service_shell.certs import make_pki

PASSWORD = "index-secret-0123456789"


@pytest.fixture
def tls_acl_redis(tmp_path):
    """redis-server on a TLS port only (client certificates required), user `gateway` with a
    password, `default` off; yields (url, pki, password file)."""
    pki = make_pki(tmp_path)
    password_file = tmp_path / "index-redis-password"
    password_file.write_text(PASSWORD + "\n")
    ok = dict(password_file=str(password_file), tls_ca=pki.ca, tls_cert=pki.client.cert,
              tls_key=pki.client.key)
    proc, port = start_redis(
        lambda port: ["--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                      "--tls-cert-file", pki.server.cert, "--tls-key-file", pki.server.key,
                      "--tls-ca-cert-file", pki.ca, "--tls-auth-clients", "yes", "--save", "",
                      "--appendonly", "no", "--dir", str(tmp_path), "--user", "default", "off",
                      "--user", "gateway", "on", f">{PASSWORD}", "~pcx:*", "+@all"],
        lambda port: _answers(_url(port), **ok))
    url = _url(port)
    try:
        yield url, ok
    finally:
        proc.kill()
        proc.wait()


def _url(port: int) -> str:
    return f"rediss://gateway@127.0.0.1:{port}/0"


def _answers(url: str, **conn) -> bool:
    try:
        return SharedIndexStore(SharedIndexConfig(url, "probe", **conn)).redis.ping()
    except redis.RedisError:
        return False


def test_a_gateway_indexes_and_routes_through_an_acl_and_tls_redis(tls_acl_redis):
    url, ok = tls_acl_redis
    args = parse_args(["--workers", "localhost:50051", "--allow-anonymous", "--index-backend",
                       "redis", "--index-redis-url", url, "--index-namespace", "secure",
                       "--index-redis-password-file", ok["password_file"],
                       "--index-redis-tls-ca", ok["tls_ca"], "--index-redis-tls-cert",
                       ok["tls_cert"], "--index-redis-tls-key", ok["tls_key"]])
    cfg = config_from_args(args)
    fields = {f: getattr(cfg, f) for f in (
        "index_backend", "index_redis_url", "index_namespace", "index_redis_password_file",
        "index_redis_tls_ca", "index_redis_tls_cert", "index_redis_tls_key")}
    with running_server() as cache:
        worker = FakeWorker("w1")
        register_pool(cache.core, "w1")
        address = [WorkerAddress(worker.address, f"127.0.0.1:{cache.port}")]
        try:
            with running_gateway(lambda: address, **fields) as gw:
                wait_until(lambda: gw.indexers.held() == 1 and gw.router.ready(),
                           what="the gateway holds w1's lease")
                tokens = prompt(1)
                cache_prompt(cache.core, "w1", tokens, salt="salt-a")  # tenant tok-a's salt
                caller = Caller(gw.address)
                wait_until(lambda: preview(caller, tokens).reason.startswith("holds 60"),
                           what="the indexed pages route")
                caller.close()
                assert not gw.router.index.health.redis_down
        finally:
            worker.stop()


@pytest.mark.parametrize("drop", ["password_file", "tls_ca", "client_cert"])
def test_without_the_password_the_ca_or_a_client_certificate_nothing_connects(tls_acl_redis,
                                                                              drop):
    url, ok = tls_acl_redis
    conn = dict(ok)
    if drop == "client_cert":
        conn.pop("tls_cert"), conn.pop("tls_key")
    else:
        conn.pop(drop)
    assert _answers(url, **ok)
    assert not _answers(url, **conn)


@pytest.mark.parametrize("flags, message", [
    (["--index-redis-password-file", "pw"], "--index-redis-password-file needs --index-redis-url"),
    (["--index-redis-url", "redis://h:1/0", "--index-redis-tls-ca", "ca.pem"], "need a rediss://"),
    (["--index-redis-url", "rediss://h:1/0", "--index-redis-tls-cert", "c.pem"],
     "--index-redis-tls-cert and --index-redis-tls-key go together"),
    (["--index-redis-url", "rediss://u:pw@h:1/0", "--index-redis-password-file", __file__],
     "holds a password already"),
    (["--index-redis-url", "redis://h:1/0", "--index-redis-password-file", "/nonexistent"],
     "no such file"),
    (["--index-redis-url", "http://h:1/0"], "scheme 'http'"),
])
def test_inconsistent_index_redis_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--workers", "localhost:50051", "--allow-anonymous", *flags])
    assert message in capsys.readouterr().err
