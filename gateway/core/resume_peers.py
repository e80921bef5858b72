"""A model server's workers (`--model-server` with `--resume-peers` / `--resume-peers-dns`): its
own worker, which every new request goes to (the Endpoint Picker chose this pod), and the pool's
other workers, where a stream goes on when its own engine dies mid-way (design.md §6, "A model
server resumes on a peer"; the resume itself is gateway/core/proxy.py's `ProxiedStream`).

The peers come from a static list or the headless Service's DNS (gateway/core/discovery.py),
which also names this pod's own worker at its pod IP: that entry is dropped (the worker is
already here, at its local address), recognised by the own worker's port and one of this host's
own addresses.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from gateway.core.discovery import WorkerAddress, split_host_port
from service_shell import kv

log = logging.getLogger("gateway.discovery")

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def own_hosts() -> frozenset[str]:
    """The names and IPs this host answers to: loopback, its hostname, and what that resolves
    to (in Kubernetes, /etc/hosts maps a pod's hostname to its pod IP)."""
    name = socket.gethostname()
    hosts = set(_LOOPBACK) | {name}
    try:
        hosts |= {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError as exc:
        log.warning(kv("own_address_unknown", hostname=name, error=exc))
    return frozenset(hosts)


class ModelServerWorkers:
    """A worker source (`GatewayConfig.workers`): `own` first, then the peers `peers()` names,
    less `own` itself. `close()` closes the peers' source when it has one."""

    def __init__(self, own: WorkerAddress, peers: Callable[[], list[WorkerAddress]],
                 hosts: frozenset[str] | None = None) -> None:
        self.own, self._peers = own, peers
        host, self._port = split_host_port(own.compute, "--workers")
        self._hosts = (own_hosts() if hosts is None else hosts) | {host.strip("[]")}

    def is_own(self, address: WorkerAddress) -> bool:
        host, port = split_host_port(address.compute, "--resume-peers")
        return address.compute == self.own.compute or (
            port == self._port and host.strip("[]") in self._hosts)

    def __call__(self) -> list[WorkerAddress]:
        return [self.own, *(p for p in self._peers() if not self.is_own(p))]

    def close(self) -> None:
        close = getattr(self._peers, "close", None)
        if close is not None:
            close()
