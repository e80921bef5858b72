"""How a gateway replica reaches the Redis of the shared routing index (gateway/core/
shared_index.py): the same URL forms, ACL password file and TLS files as the services' L3
connection (service_shell/redis_flags.py, pagestore/settings.py), under the gateway's own flags
--index-redis-url, --index-redis-password-file, --index-redis-tls-ca/-cert/-key. The gateway
imports no pagestore module (tests/test_import_rules.py), so the few lines that turn them into a
redis-py client live here too.

    redis://[user[:password]@]host:port/db, rediss:// for TLS,
    redis+cluster://host:port (rediss+cluster://) for a Redis Cluster: any node
"""
from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)


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
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"--index-redis-url: scheme {parts.scheme!r} is not one of "
                             f"{', '.join(SCHEMES)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--index-redis-tls-cert and --index-redis-tls-key go together")
        if (self.tls_ca or self.tls_cert) and self.scheme != "rediss":
            raise ValueError("--index-redis-tls-ca/-cert need a rediss:// (TLS) --index-redis-url")
        if self.password_file and parts.password:
            raise ValueError("--index-redis-password-file: the --index-redis-url holds a "
                             "password already; give it in one place")
        if self.password_file and self.password is None:
            path = Path(self.password_file)
            if not path.is_file():
                raise ValueError(f"--index-redis-password-file {self.password_file}: no such file")
            object.__setattr__(self, "password", path.read_text().strip())

    @property
    def cluster(self) -> bool:
        return urllib.parse.urlsplit(self.url).scheme in CLUSTER_SCHEMES

    @property
    def scheme(self) -> str:
        """redis, rediss or unix (the +cluster suffix dropped)."""
        scheme = urllib.parse.urlsplit(self.url).scheme
        return CLUSTER_SCHEMES.get(scheme, scheme)

    def redacted(self) -> str:
        """The URL with any password replaced by ***: what logs may show."""
        parts = urllib.parse.urlsplit(self.url)
        if parts.password is None:
            return self.url
        host = parts.netloc.rpartition("@")[2]
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))

    def connect(self, timeout_s: float = 1.0) -> redis.Redis | RedisCluster:
        """A client; redis-py's cluster client for a cluster, which asks a node for the slot map
        at once (raises when none answers)."""
        kwargs: dict = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        if self.password is not None:
            kwargs["password"] = self.password
        if self.scheme == "rediss":
            kwargs["ssl_cert_reqs"] = "required"
            if self.tls_ca:
                kwargs["ssl_ca_certs"] = self.tls_ca
            if self.tls_cert:
                kwargs["ssl_certfile"], kwargs["ssl_keyfile"] = self.tls_cert, self.tls_key
        url = urllib.parse.urlunsplit(urllib.parse.urlsplit(self.url)._replace(scheme=self.scheme))
        if self.cluster:
            # A master that dies leaves the other slots usable (cluster-require-full-coverage
            # no on the servers): the client must not refuse a partial slot map either. No
            # retries inside redis-py (as pagestore's L3 client): a routing lookup waits on
            # Redis, and a failure is "no prefix knowledge" now; indexers retry their turn.
            return RedisCluster.from_url(url, require_full_coverage=False,
                                         retry=Retry(NoBackoff(), 0), **kwargs)
        return redis.Redis.from_url(url, **kwargs)
