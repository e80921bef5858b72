"""How a gateway replica reaches the Redis of the shared routing index (gateway/core/
shared_index.py): the same URL forms, ACL password file and TLS files as the services' L3
connection (service_shell/redis_flags.py, pagestore/settings.py), under the gateway's own flags
--index-redis-url, --index-redis-password-file, --index-redis-tls-ca/-cert/-key. The gateway
imports no pagestore module (tests/test_import_rules.py): the URL forms, the checks of those
flags, the password and TLS arguments and the redaction are prefixcache_client.redis_target's,
which pagestore's settings use too; the client itself (timeouts, no retries) is made here.

    redis://[user[:password]@]host:port/db, rediss:// for TLS,
    redis+cluster://host:port (rediss+cluster://) for a Redis Cluster: any node
"""
from __future__ import annotations

from dataclasses import dataclass, field

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from prefixcache_client.redis_target import (CLUSTER_SCHEMES, auth_kwargs, base_scheme,
                                             check_scheme, checked_password, plain_url, redact,
                                             url_scheme)


@dataclass(frozen=True, slots=True)
class IndexRedis:
    """Where the index's Redis is and how to authenticate to it; `url` may hold a password: log
    `redacted()` only. An inconsistent set raises ValueError naming the flag."""
    url: str
    password_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # Read from password_file when made; never shown by repr (logs, tracebacks).
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_scheme(self.url, "--index-redis-url")
        object.__setattr__(self, "password", checked_password(
            self.url, self.password_file, self.password, self.tls_ca, self.tls_cert, self.tls_key,
            "--index-redis"))

    @property
    def cluster(self) -> bool:
        return url_scheme(self.url) in CLUSTER_SCHEMES

    @property
    def scheme(self) -> str:
        """redis, rediss or unix (the +cluster suffix dropped)."""
        return base_scheme(self.url)

    def redacted(self) -> str:
        """The URL with any password replaced by ***: what logs may show."""
        return redact(self.url)

    def connect(self, timeout_s: float = 1.0) -> redis.Redis | RedisCluster:
        """A client; redis-py's cluster client for a cluster, which asks a node for the slot map
        at once (raises when none answers)."""
        kwargs = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                      **auth_kwargs(self.url, self.password, self.tls_ca, self.tls_cert,
                                    self.tls_key))
        url = plain_url(self.url)
        if self.cluster:
            # A master that dies leaves the other slots usable (cluster-require-full-coverage
            # no on the servers): the client must not refuse a partial slot map either. No
            # retries inside redis-py (as pagestore's L3 client): a routing lookup waits on
            # Redis, and a failure is "no prefix knowledge" now; indexers retry their turn.
            return RedisCluster.from_url(url, require_full_coverage=False,
                                         retry=Retry(NoBackoff(), 0), **kwargs)
        return redis.Redis.from_url(url, **kwargs)
