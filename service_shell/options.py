"""gRPC channel arguments shared by every server and client of the project: message-size limits
both ways, keepalive tuned so that neither side answers the other's pings with GOAWAY, fast
reconnects, and strict port ownership."""
from __future__ import annotations

import json

from service_shell.retry import RECONNECT_RETRY


def server_options(max_message_mb: int, *, keepalive_time_s: float = 20.0,
                   keepalive_timeout_s: float = 10.0,
                   min_ping_interval_s: float = 5.0) -> list[tuple[str, int]]:
    """Message-size limits, keepalive of idle connections and strict port ownership."""
    if max_message_mb < 1:
        raise ValueError(f"max_message_mb must be >= 1, got {max_message_mb}")
    max_bytes = max_message_mb * 1024 * 1024
    ping_ms = int(min_ping_interval_s * 1000)
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
        # Server pings idle connections so that a dead peer's stream is torn down.
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # Long streams may be quiet (a long prefill, a subscription between heartbeats): allow
        # pings regardless of data.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", ping_ms),
        ("grpc.http2.min_ping_interval_without_data_ms", ping_ms),
        # A second server on the same port must fail loudly, not share the port silently.
        ("grpc.so_reuseport", 0),
    ]


def channel_options(max_message_mb: int,
                    service_config: dict | None = None) -> list[tuple[str, int | str]]:
    """Client side of `server_options`, plus fast reconnects and an optional service config.

    This is the transport layer of retrying (service_shell/retry.py): the channel's reconnect
    backoff, and with a service config gRPC's own retries of the idempotent unary calls it
    names (`RetryPolicy.grpc_retry_policy`). Loops above it (resubscribing, reconnecting a
    stream, retrying an engine step) take a `RetryPolicy` themselves."""
    max_bytes = max_message_mb * 1024 * 1024
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
        # Detect a dead server under a quiet stream; 10 s is above the servers' minimum ping
        # interval (5 s), so they never answer our pings with GOAWAY.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC's default reconnect backoff (1 s, up to 120 s) would dominate a server restart:
        # the project's reconnect policy instead (0.1 s up to 5 s, as the gateway's loops).
        ("grpc.initial_reconnect_backoff_ms", round(RECONNECT_RETRY.initial_s * 1000)),
        ("grpc.max_reconnect_backoff_ms", round(RECONNECT_RETRY.max_s * 1000)),
    ]
    if service_config is not None:
        options += [("grpc.service_config", json.dumps(service_config)), ("grpc.enable_retries", 1)]
    return options
