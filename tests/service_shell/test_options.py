"""Channel arguments and flags: what every server and client of the project shares."""
from __future__ import annotations

import argparse
import json

import pytest

from service_shell import (TlsConfig, add_server_flags, channel_options, env_default,
                           server_options, tls_from_args)


def test_server_options_limit_messages_and_own_the_port():
    opts = dict(server_options(8, min_ping_interval_s=2.0))
    assert opts["grpc.max_send_message_length"] == 8 << 20
    assert opts["grpc.max_receive_message_length"] == 8 << 20
    assert opts["grpc.http2.min_recv_ping_interval_without_data_ms"] == 2000
    assert opts["grpc.so_reuseport"] == 0
    with pytest.raises(ValueError, match="max_message_mb"):
        server_options(0)


def test_client_pings_less_often_than_servers_allow():
    client, server = dict(channel_options(4)), dict(server_options(4))
    assert client["grpc.keepalive_time_ms"] >= server[
        "grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert client["grpc.max_receive_message_length"] == 4 << 20
    assert "grpc.service_config" not in client


def test_channel_options_carry_a_service_config_with_retries():
    config = {"methodConfig": [{"name": [{"service": "s"}]}]}
    opts = dict(channel_options(1, config))
    assert json.loads(opts["grpc.service_config"]) == config
    assert opts["grpc.enable_retries"] == 1


def test_env_default(monkeypatch):
    monkeypatch.delenv("PREFIXCACHE_X", raising=False)
    assert (env_default("X", 5), env_default("X", None)) == ("5", None)
    monkeypatch.setenv("PREFIXCACHE_X", "7")
    assert env_default("X", 5) == "7"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_server_flags(p, env_prefix="THING", host="[::]", port=1234, max_message_mb=16)
    return p


def test_server_flags_defaults(monkeypatch):
    for var in ("THING_HOST", "THING_PORT", "METRICS_PORT", "HEALTH_PORT", "MAX_MESSAGE_MB",
                "TLS_CERT", "TLS_KEY", "TLS_CA", "TLS_SERVER_NAME", "LOG_LEVEL"):
        monkeypatch.delenv(f"PREFIXCACHE_{var}", raising=False)
    p = _parser()
    args = p.parse_args([])
    assert (args.host, args.port, args.metrics_port, args.health_port, args.max_message_mb,
            args.log_level) == ("[::]", 1234, 0, 0, 16, "INFO")
    assert tls_from_args(p, args) is None  # plaintext unless configured


def test_server_flags_read_the_environment(monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_THING_PORT", "6000")
    monkeypatch.setenv("PREFIXCACHE_HEALTH_PORT", "8081")
    monkeypatch.setenv("PREFIXCACHE_TLS_CERT", "/tls/tls.crt")
    monkeypatch.setenv("PREFIXCACHE_TLS_KEY", "/tls/tls.key")
    monkeypatch.setenv("PREFIXCACHE_TLS_CA", "/tls/ca.crt")
    monkeypatch.setenv("PREFIXCACHE_TLS_SERVER_NAME", "")  # empty = not set
    monkeypatch.setenv("PREFIXCACHE_LOG_LEVEL", "debug")
    p = _parser()
    args = p.parse_args([])
    assert (args.port, args.health_port, args.log_level) == (6000, 8081, "DEBUG")
    assert tls_from_args(p, args) == TlsConfig("/tls/tls.crt", "/tls/tls.key", "/tls/ca.crt")
    assert p.parse_args(["--health-port", "9"]).health_port == 9  # flags win


def test_a_cert_without_its_key_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.delenv("PREFIXCACHE_TLS_KEY", raising=False)
    p = _parser()
    with pytest.raises(SystemExit) as exc:
        tls_from_args(p, p.parse_args(["--tls-cert", "/tls/tls.crt"]))
    assert exc.value.code == 2
    assert "--tls-key (PREFIXCACHE_TLS_KEY)" in capsys.readouterr().err
