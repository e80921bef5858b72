"""Where Redis is and how to reach it: `RedisSettings` (standalone or Redis Cluster, TLS, ACL
user and password), the one place that builds the redis-py client, the start-up reachability
check, and `redact` (a URL as logs may show it).

A URL is redis://[user[:password]@]host:port/db, rediss:// for TLS, redis+cluster://host:port (or
rediss+cluster://) for a Redis Cluster (any node; the client learns the others from it). The
settings are built from the services' flags by `service_shell.redis_flags` (--redis-url,
--redis-cluster, --redis-password-file, --redis-tls-ca/-cert/-key); this module reads no flag and
no environment variable, only the password file it is given.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

# The URL forms, checks and redaction shared with the gateway's index Redis (which may not
# import pagestore); `redact` stays importable from here.
from prefixcache_client.redis_target import (CLUSTER_SCHEMES, auth_kwargs, base_scheme,
                                             check_scheme, checked_password, plain_url, redact,
                                             url_scheme)

__all__ = ["RedisSettings", "redact"]


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Where Redis is and how to authenticate to it; `url` is as given (may hold a password:
    log `redacted()` only)."""
    url: str
    cluster: bool = False
    password_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # Read from password_file when the settings are made; never shown by repr (logs, tracebacks).
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_scheme(self.url, "--redis-url")
        scheme = url_scheme(self.url)
        if scheme in CLUSTER_SCHEMES:
            object.__setattr__(self, "cluster", True)
        if self.cluster and scheme == "unix":
            raise ValueError("--redis-url: a Redis Cluster is reached over TCP, not a unix socket")
        object.__setattr__(self, "password", checked_password(
            self.url, self.password_file, self.password, self.tls_ca, self.tls_cert, self.tls_key,
            "--redis"))

    @property
    def scheme(self) -> str:
        """redis, rediss or unix (the +cluster suffix dropped)."""
        return base_scheme(self.url)

    def plain_url(self) -> str:
        """The URL redis-py parses: the scheme without +cluster."""
        return plain_url(self.url)

    def redacted(self) -> str:
        """The URL with any password replaced by ***: what logs and metrics may show."""
        return redact(self.url)

    def client_kwargs(self) -> dict:
        return auth_kwargs(self.url, self.password, self.tls_ca, self.tls_cert, self.tls_key)

    def connect(self, *, socket_timeout: float, connect_timeout: float,
                max_connections: int) -> redis.Redis | RedisCluster:
        """A client (redis-py's cluster client for a cluster). A cluster client connects to a
        startup node at once to learn the slot map: that raises when none answers."""
        kwargs = dict(socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                      max_connections=max_connections, **self.client_kwargs())
        if self.cluster:
            # A master without a replica that dies must leave the other slots usable: the
            # servers run with cluster-require-full-coverage no, and the client must not
            # refuse a partial slot map either.
            # No retries inside redis-py: a failure is a miss now, the breaker decides later.
            return RedisCluster.from_url(self.plain_url(), require_full_coverage=False,
                                         retry=Retry(NoBackoff(), 0), **kwargs)
        return redis.Redis.from_url(self.plain_url(), retry_on_timeout=False, **kwargs)

    def check(self, timeout_s: float) -> str | None:
        """None when Redis answers PING (every master, for a cluster) within `timeout_s`, else
        the cause, one line (the exception's type and message, without the password)."""
        client = None
        try:
            client = self.connect(socket_timeout=timeout_s, connect_timeout=timeout_s,
                                  max_connections=2)
            if isinstance(client, RedisCluster):
                masters = client.get_primaries()
                for node in masters:
                    client.ping(target_nodes=node)
                if not masters:
                    return "the cluster reports no masters"
            else:
                client.ping()
            return None
        except Exception as exc:  # noqa: BLE001 - any failure is a cause to report, not raise
            return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
        finally:
            if client is not None:
                client.close()

