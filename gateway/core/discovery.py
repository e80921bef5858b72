"""Where the workers are: a static list (--workers) or the DNS of a headless Kubernetes Service
(--workers-dns), re-resolved periodically so that workers join and leave without a restart.

Each worker is a compute address and the address of the cache service whose event stream
describes its pool; in Kubernetes that is the worker pod's cache sidecar, at the same IP on the
cache port.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from service_shell import kv

log = logging.getLogger("gateway.discovery")


@dataclass(frozen=True, slots=True, order=True)
class WorkerAddress:
    compute: str
    cache: str


def split_host_port(address: str, what: str) -> tuple[str, int]:
    """HOST:PORT or [V6]:PORT -> (host as written, port). ValueError naming `what`."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: {address!r} is not HOST:PORT")
    return host, int(port)


def parse_static(spec: str, cache_port: int) -> list[WorkerAddress]:
    """`COMPUTE_ADDR[@CACHE_ADDR],...`; the cache address defaults to the compute host with
    `cache_port`. ValueError naming --workers and the bad entry."""
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        compute, _, cache = entry.partition("@")
        host, _ = split_host_port(compute, "--workers")
        if cache:
            split_host_port(cache, "--workers")
        out.append(WorkerAddress(compute, cache or f"{host}:{cache_port}"))
    if len({w.compute for w in out}) != len(out):
        raise ValueError(f"--workers: {spec!r} names a compute address twice")
    return out


Resolve = Callable[[str, int], list[str]]


def resolve_ips(host: str, port: int) -> list[str]:
    """The IPs `host` resolves to (a headless Service: one A/AAAA record per ready pod)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


class DnsWorkers:
    """The workers behind a DNS name, as of the last `__call__`. A failed lookup keeps the last
    answer: a DNS hiccup must not drop every worker's warm index (workers that are really gone
    stop answering their readiness probes and leave the routing anyway)."""

    def __init__(self, target: str, cache_port: int, resolve: Resolve = resolve_ips) -> None:
        self.host, self.port = split_host_port(target, "--workers-dns")
        self.cache_port = cache_port
        self._resolve = resolve
        self._last: list[WorkerAddress] = []

    def __call__(self) -> list[WorkerAddress]:
        try:
            ips = self._resolve(self.host.strip("[]"), self.port)
        except OSError as exc:
            log.warning(kv("dns_resolve_failed", name=self.host, error=exc,
                           kept_workers=len(self._last)))
            return self._last
        hosts = [f"[{ip}]" if ":" in ip else ip for ip in ips]
        self._last = [WorkerAddress(f"{h}:{self.port}", f"{h}:{self.cache_port}") for h in hosts]
        return self._last


def static_workers(addresses: list[WorkerAddress]) -> Callable[[], list[WorkerAddress]]:
    return lambda: list(addresses)
