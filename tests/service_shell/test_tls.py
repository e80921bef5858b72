"""TLS and mTLS from PEM files: a cache service that requires client certificates, and the
clients that do and do not get through. Over real gRPC on loopback, with a throwaway CA."""
from __future__ import annotations

import dataclasses
import logging
import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixcache_client.cache import CacheClient, CacheUnavailableError
from service_shell import TlsConfig, tls_mode
from stack.launcher import free_port
from tests.cache_service.grpc_harness import register, running_server, server_process
from tests.service_shell.certs import Pki, server_of_another_ca

SERVING = health_pb2.HealthCheckResponse.SERVING


def mtls_server(pki: Pki) -> TlsConfig:
    return TlsConfig(cert=pki.server.cert, key=pki.server.key, ca=pki.ca)


def mtls_client(pki: Pki, **override: str) -> TlsConfig:
    return TlsConfig(cert=pki.client.cert, key=pki.client.key, ca=pki.ca, **override)


def lists_pools(target: str, **client) -> bool:
    """True when a ListPools call gets through; False when the connection is refused."""
    with CacheClient(target, timeout_s=2, **client) as c:
        try:
            c.list_pools()
        except CacheUnavailableError:
            return False
    return True


@pytest.fixture(scope="module")
def mtls_target(pki):
    with running_server(tls=mtls_server(pki), health_port=0) as server:
        yield server


def test_client_with_the_right_certificates_gets_through(pki, mtls_target):
    target = f"127.0.0.1:{mtls_target.port}"
    with CacheClient(target, timeout_s=5, tls=mtls_client(pki)) as client:
        client.register_pool(register())
        assert [p.pool_id for p in client.list_pools().pools] == ["pool-a"]
    # The certificate names localhost too.
    assert lists_pools(f"localhost:{mtls_target.port}", tls=mtls_client(pki))


@pytest.mark.parametrize("client", ["plaintext", "no client certificate", "foreign certificate",
                                    "unverified server"])
def test_clients_without_a_trusted_certificate_are_refused(pki, mtls_target, client):
    tls = {"plaintext": None,
           "no client certificate": TlsConfig(ca=pki.ca),
           "foreign certificate": TlsConfig(pki.stranger.cert, pki.stranger.key, pki.ca),
           # The system's roots do not know our CA.
           "unverified server": TlsConfig(pki.client.cert, pki.client.key)}[client]
    assert not lists_pools(f"127.0.0.1:{mtls_target.port}", tls=tls)


def test_health_port_stays_plaintext(mtls_target):
    with grpc.insecure_channel(f"127.0.0.1:{mtls_target.health_port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
    assert reply.status == SERVING


def test_tls_without_a_ca_does_not_ask_for_client_certificates(pki):
    tls = TlsConfig(cert=pki.server.cert, key=pki.server.key)
    assert (tls_mode(tls), tls_mode(mtls_server(pki)), tls_mode(None)) == (
        "tls", "mtls", "plaintext")
    with running_server(tls=tls) as server:
        target = f"127.0.0.1:{server.port}"
        assert lists_pools(target, tls=TlsConfig(ca=pki.ca))
        assert not lists_pools(target)


def test_server_name_override_for_servers_dialed_by_ip(pki):
    named = TlsConfig(cert=pki.named_server.cert, key=pki.named_server.key, ca=pki.ca)
    with running_server(tls=named) as server:
        target = f"127.0.0.1:{server.port}"
        assert not lists_pools(target, tls=mtls_client(pki))  # 127.0.0.1 is not in the cert
        assert lists_pools(target, tls=mtls_client(pki, server_name="cache.test"))


def test_a_renewed_server_certificate_serves_new_connections_without_a_restart(pki, tmp_path, caplog):
    live_cert, live_key = tmp_path / "live.crt", tmp_path / "live.key"
    shutil.copy(pki.server.cert, live_cert)
    shutil.copy(pki.server.key, live_key)
    new_ca, renewed = server_of_another_ca(tmp_path)
    old_clients, new_clients = TlsConfig(ca=pki.ca), TlsConfig(ca=new_ca)
    with running_server(tls=TlsConfig(cert=str(live_cert), key=str(live_key))) as server:
        target = f"127.0.0.1:{server.port}"
        assert lists_pools(target, tls=old_clients) and not lists_pools(target, tls=new_clients)
        # Half a rotation (the new certificate, the old key) is refused: the old pair still serves.
        shutil.copy(renewed.cert, live_cert)
        with caplog.at_level(logging.WARNING, logger="service_shell.tls"):
            assert lists_pools(target, tls=old_clients)
        assert "event=tls_reload_failed" in caplog.text
        # The whole rotation: new connections get the new certificate, from the same process.
        shutil.copy(renewed.key, live_key)
        assert lists_pools(target, tls=new_clients)
        assert not lists_pools(target, tls=old_clients)


def test_tls_and_credentials_are_exclusive(pki):
    with pytest.raises(ValueError, match="not both"):
        CacheClient("127.0.0.1:1", tls=mtls_client(pki),
                    credentials=grpc.ssl_channel_credentials())


def test_bad_settings_name_the_flag(pki, tmp_path):
    with pytest.raises(ValueError, match=r"--tls-cert \(PREFIXCACHE_TLS_CERT\) and --tls-key"):
        TlsConfig(cert=pki.server.cert)
    with pytest.raises(ValueError, match=r"--tls-ca \(PREFIXCACHE_TLS_CA\) alone"):
        TlsConfig(ca=pki.ca).server_credentials()
    missing = dataclasses.replace(mtls_server(pki), ca=str(tmp_path / "nope.crt"))
    with pytest.raises(OSError, match=r"--tls-ca \(PREFIXCACHE_TLS_CA\): cannot read .*nope"):
        missing.server_credentials()
    (tmp_path / "junk.key").write_text("not a key")
    junk = dataclasses.replace(mtls_server(pki), key=str(tmp_path / "junk.key"))
    with pytest.raises(ValueError, match=r"--tls-key .*junk.key is not a PEM file"):
        junk.server_credentials()
    # A server with unreadable files fails its start before it takes its port.
    with pytest.raises(OSError, match="cannot read"):
        with running_server(tls=missing):
            pass


def test_from_env_treats_empty_as_unset(pki):
    assert TlsConfig.from_env({}) is None
    assert TlsConfig.from_env({"PREFIXCACHE_TLS_CA": pki.ca, "PREFIXCACHE_TLS_CERT": ""}) == (
        TlsConfig(ca=pki.ca))


def test_cli_serves_mtls_and_a_plaintext_health_port_from_the_environment(pki):
    health_port = free_port()
    env = {"PREFIXCACHE_TLS_CERT": pki.server.cert, "PREFIXCACHE_TLS_KEY": pki.server.key,
           "PREFIXCACHE_TLS_CA": pki.ca, "PREFIXCACHE_HEALTH_PORT": str(health_port)}
    with server_process(0, "--grace-s", "0", env=env) as proc:
        assert lists_pools(proc.target, tls=mtls_client(pki))
        assert not lists_pools(proc.target)
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status == SERVING
        proc.terminate()
        assert proc.exit_code() == 0, proc.log()
        log = proc.log()
    assert f"health_port={health_port} tls=mtls" in log
