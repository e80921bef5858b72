"""Issue 25, finding 10: the HTTP port answered 300 of 300 requests at 745-1,104 req/s with 200;
200 connections sending one header byte every 5 s were never closed; and a renewed TLS
certificate was picked up by gRPC but not by HTTP. Now: per-tenant rate and in-flight limits
(429 with Retry-After, counted per tenant and reason), a deadline on a request's head and body,
a connection cap, and the HTTP port's certificate reloaded like the gRPC port's.

Against a real in-process gateway over fake workers (tests/gateway), loopback only, bounded in
count and time."""
from __future__ import annotations

import json
import select
import shutil
import socket
import ssl
import threading
import time

import httpx
import pytest
from fastapi import FastAPI

from gateway.core.tenants import TenantDirectory
from gateway.http.limits import TenantLimiter, TenantLimits
from gateway.http.bounds import HttpLimits
from gateway.http.server import HttpServer
from service_shell import TlsConfig
from tests.gateway.gateway_harness import wait_until
from tests.gateway.http_helpers import auth
from tests.gateway.server_helpers import fake_fleet
from tests.service_shell.certs import make_pki, server_of_another_ca

P = [1, 2, 3, 4, 5]
RATE, BURST, IN_FLIGHT = 20.0, 10, 2
HEADER_TIMEOUT_S, MAX_CONNECTIONS = 1.0, 40


@pytest.fixture(scope="module")
def gateway():
    limits = TenantLimits(rate_per_s=RATE, burst=BURST, max_in_flight=IN_FLIGHT)
    with fake_fleet(http_port=0, tokenizer="byte", http_tenant_limits=limits,
                    http_limits=HttpLimits(header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=2.0,
                                           max_connections=MAX_CONNECTIONS)) \
            as (gw, _, workers, _, _):
        base = f"http://127.0.0.1:{gw.http_port}"
        wait_until(lambda: httpx.get(base + "/health").status_code == 200, what="HTTP health")
        yield gw, workers, base


def _throttled(gw, tenant: str, reason: str) -> float:
    return gw.metrics.registry.get_sample_value(
        "prefixcache_gateway_http_throttled_total", {"tenant": tenant, "reason": reason}) or 0.0


def _idle(tenant_token: str, base: str) -> None:
    """Waits until the tenant's bucket is full again (BURST / RATE seconds)."""
    time.sleep(BURST / RATE + 0.1)


def test_attack_http_flood_past_the_tenants_rate(gateway):
    gw, _, base = gateway
    _idle("tok-a", base)
    codes, retry_after = [], set()
    start = time.perf_counter()
    with httpx.Client(base_url=base, headers=auth("tok-a"), timeout=10) as client:
        for _ in range(300):
            r = client.get("/v1/models")
            codes.append(r.status_code)
            if r.status_code == 429:
                retry_after.add(r.headers["retry-after"])
                body = r.json()["error"]
                assert body["type"] == "rate_limit_error" and body["code"] == "rate_limit_exceeded"
                assert "tenant 'tenant-a'" in body["message"]
        # Another tenant has a budget of its own.
        assert client.get("/v1/models", headers=auth("tok-b")).status_code == 200
    seconds = time.perf_counter() - start
    ok = codes.count(200)
    print(f"300 requests in {seconds:.2f} s ({300 / seconds:.0f} req/s): {ok} x 200, "
          f"{codes.count(429)} x 429, Retry-After {sorted(retry_after)}")
    assert set(codes) == {200, 429}
    assert ok <= BURST + RATE * seconds + 1  # the bucket: burst, then the rate
    assert retry_after == {"1"}
    assert _throttled(gw, "tenant-a", "rate") == codes.count(429)
    assert _throttled(gw, "tenant-b", "rate") == 0


def test_attack_http_streams_past_the_tenants_in_flight_limit(gateway):
    gw, workers, base = gateway
    _idle("tok-b", base)
    for w in workers.values():
        w.tokens, w.delay_s = 20, 0.05
    started = threading.Barrier(IN_FLIGHT + 1)
    done: list[int] = []

    def read() -> None:
        with httpx.stream("POST", base + "/v1/completions", headers=auth("tok-b"), timeout=30,
                          json={"prompt": P, "stream": True, "max_tokens": 20}) as r:
            started.wait(10)
            done.append(r.status_code)
            for _ in r.iter_lines():
                pass

    try:
        readers = [threading.Thread(target=read) for _ in range(IN_FLIGHT)]
        for t in readers:
            t.start()
        started.wait(10)
        r = httpx.post(base + "/v1/completions", headers=auth("tok-b"), timeout=10,
                       json={"prompt": P, "max_tokens": 1})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_in_flight"
        assert _throttled(gw, "tenant-b", "in_flight") == 1
        for t in readers:
            t.join(30)
        assert done == [200] * IN_FLIGHT
        # The slots came back with the streams' ends.
        r = httpx.post(base + "/v1/completions", headers=auth("tok-b"), timeout=10,
                       json={"prompt": P, "max_tokens": 1})
        assert r.status_code == 200, r.text
    finally:
        for w in workers.values():
            w.tokens, w.delay_s = 3, 0.0


def _slow_clients(port: int, count: int, byte_every_s: float, limit_s: float
                  ) -> list[float | None]:
    """`count` connections that each send one byte of a request head every `byte_every_s`;
    how long each stayed open (None: still open after `limit_s`)."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]
    opened = time.monotonic()
    closed: list[float | None] = [None] * count
    sent = 0
    try:
        while time.monotonic() - opened < limit_s and None in closed:
            for i, s in enumerate(socks):
                if closed[i] is not None:
                    continue
                try:
                    s.sendall(head[sent:sent + 1])
                    s.setblocking(False)
                    try:
                        if s.recv(1) == b"":
                            closed[i] = time.monotonic() - opened
                    except BlockingIOError:
                        pass
                    finally:
                        s.setblocking(True)
                except OSError:
                    closed[i] = time.monotonic() - opened
            sent += 1
            time.sleep(byte_every_s)
    finally:
        for s in socks:
            s.close()
    return closed


def test_attack_slowloris_connections_are_closed_after_the_header_timeout(gateway):
    gw, _, base = gateway
    count = 30
    closed = _slow_clients(gw.http_port, count, byte_every_s=0.2, limit_s=4 * HEADER_TIMEOUT_S)
    after = [c for c in closed if c is not None]
    print(f"slow-header clients: {len(after)} of {count} closed, after "
          f"{min(after, default=0):.2f}-{max(after, default=0):.2f} s "
          f"(header timeout {HEADER_TIMEOUT_S} s)")
    assert len(after) == count
    assert HEADER_TIMEOUT_S - 0.1 <= min(after) and max(after) <= HEADER_TIMEOUT_S + 1.0
    assert gw.metrics.registry.get_sample_value(
        "prefixcache_gateway_http_connections_closed_total",
        {"reason": "header_timeout"}) >= count
    # The port still serves.
    assert httpx.get(base + "/health").status_code == 200


def test_attack_connections_past_the_cap_are_closed(gateway):
    gw, _, base = gateway
    socks = [socket.create_connection(("127.0.0.1", gw.http_port), timeout=5)
             for _ in range(MAX_CONNECTIONS + 10)]
    try:
        time.sleep(0.3 * HEADER_TIMEOUT_S)  # well before the header timeout
        readable, _, _ = select.select(socks, [], [], 0)
        shut = sum(1 for s in readable if s.recv(1) == b"")
        # The ones past the cap, at once (a connection of an earlier test that the server has
        # not yet seen close may take one more slot); the others wait for their head.
        assert 10 <= shut <= 15, shut
    finally:
        for s in socks:
            s.close()
    assert gw.metrics.registry.get_sample_value(
        "prefixcache_gateway_http_connections_closed_total", {"reason": "connection_cap"}) >= 10
    wait_until(lambda: httpx.get(base + "/health").status_code == 200, what="serving again")


def test_a_slow_body_is_closed_after_the_body_timeout(gateway):
    gw, _, _ = gateway
    with socket.create_connection(("127.0.0.1", gw.http_port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-a\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        start = time.monotonic()
        s.settimeout(5)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        waited = time.monotonic() - start
    assert 1.5 < waited < 4.0, waited  # body_timeout_s=2


def test_tenants_file_limits_override_the_defaults(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tokens": {
        "t1": {"tenant": "big", "salt": "s", "rate_per_s": 1000, "max_in_flight": 0},
        "t2": {"tenant": "big", "salt": "s", "rate_per_s": 1000, "max_in_flight": 0},
        "t3": {"tenant": "small", "salt": "x", "burst": 1, "rate_per_s": 0.5}}}))
    tenants = TenantDirectory.from_file(path)
    now = [0.0]
    limiter = TenantLimiter(TenantLimits(10, 20, 2), tenants.limits, clock=lambda: now[0])
    assert limiter.limits("big") == TenantLimits(1000, 20, 0)
    assert limiter.limits("small") == TenantLimits(0.5, 1, 2)
    assert limiter.limits("other") == TenantLimits(10, 20, 2)
    assert limiter.acquire("small") is None
    assert limiter.acquire("small") == ("rate", 2)
    now[0] = 2.0
    assert limiter.acquire("small") is None
    assert limiter.acquire("small") == ("in_flight", 1)
    for bad in ({"rate_per_s": -1}, {"burst": 1.5}, {"max_in_flight": "3"}):
        path.write_text(json.dumps({"tokens": {"t": {"tenant": "a", **bad}}}))
        with pytest.raises(ValueError, match=next(iter(bad))):
            TenantDirectory.from_file(path)
    path.write_text(json.dumps({"tokens": {"t": {"tenant": "a", "burst": 1},
                                           "u": {"tenant": "a", "burst": 2}}}))
    with pytest.raises(ValueError, match="other limits"):
        TenantDirectory.from_file(path)


def _served_certificate(port: int, ca: str) -> bytes | None:
    """The DER certificate the port serves to a client trusting `ca`; None when refused."""
    context = ssl.create_default_context(cafile=ca)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname="localhost") as tls:
            return tls.getpeercert(binary_form=True)
    except ssl.SSLError:
        return None


def test_a_renewed_certificate_is_served_on_http_after_reload(tmp_path):
    pki = make_pki(tmp_path)
    live_cert, live_key = tmp_path / "live.crt", tmp_path / "live.key"
    shutil.copy(pki.server.cert, live_cert)
    shutil.copy(pki.server.key, live_key)
    new_ca, renewed = server_of_another_ca(tmp_path)
    app = FastAPI()
    server = HttpServer(app, "127.0.0.1", 0, tls=TlsConfig(cert=str(live_cert), key=str(live_key)),
                        tls_reload_s=0.1).start()
    try:
        assert _served_certificate(server.port, pki.ca) is not None
        assert _served_certificate(server.port, new_ca) is None
        # Half a rotation (the new certificate, the old key) is not loaded: the old pair serves.
        shutil.copy(renewed.cert, live_cert)
        time.sleep(0.5)
        assert _served_certificate(server.port, pki.ca) is not None
        shutil.copy(renewed.key, live_key)
        wait_until(lambda: _served_certificate(server.port, new_ca) is not None, timeout_s=5,
                   what="the renewed certificate on HTTP")
        assert _served_certificate(server.port, pki.ca) is None
    finally:
        server.stop(2.0)
