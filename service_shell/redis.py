"""How both services reach Redis (the L3 page store): one set of flags, one `RedisSettings`, one
place that builds the client (standalone or Redis Cluster, TLS, ACL user and password) and the
start-up reachability check.

    --redis-url           redis://[user[:password]@]host:port/db, rediss:// for TLS,
                          redis+cluster://host:port (or rediss+cluster://) for a Redis Cluster:
                          any node; the client learns the others from it
    --redis-cluster       the same as a +cluster scheme, for URLs given as redis://
    --redis-password-file the ACL password, read from a file (a mounted Secret), so that it is
                          on no command line and in no environment listing; the URL's user name
                          (redis://USER@host) goes with it
    --redis-tls-ca/-cert/-key  PEM files: the CA Redis's certificate is checked against, and a
                          client certificate for a Redis that requires one (tls-auth-clients)

Imported by the cache service and the compute service only (it needs redis-py; the gateway and
the torch-free clients never import it, so service_shell's package does not re-export it).
"""
from __future__ import annotations

import argparse
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from service_shell.flags import add_flag

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)


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
        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"--redis-url: scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
        if scheme in CLUSTER_SCHEMES:
            object.__setattr__(self, "cluster", True)
        if self.cluster and scheme == "unix":
            raise ValueError("--redis-url: a Redis Cluster is reached over TCP, not a unix socket")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--redis-tls-cert and --redis-tls-key go together")
        if (self.tls_ca or self.tls_cert) and self.scheme != "rediss":
            raise ValueError("--redis-tls-ca/--redis-tls-cert need a rediss:// (TLS) --redis-url")
        if self.password_file and urllib.parse.urlsplit(self.url).password:
            raise ValueError("--redis-password-file: the --redis-url holds a password already; "
                             "give it in one place")
        if self.password_file and self.password is None:
            path = Path(self.password_file)
            if not path.is_file():
                raise ValueError(f"--redis-password-file {self.password_file}: no such file")
            object.__setattr__(self, "password", path.read_text().strip())

    @property
    def scheme(self) -> str:
        """redis, rediss or unix (the +cluster suffix dropped)."""
        scheme = urllib.parse.urlsplit(self.url).scheme
        return CLUSTER_SCHEMES.get(scheme, scheme)

    def plain_url(self) -> str:
        """The URL redis-py parses: the scheme without +cluster."""
        parts = urllib.parse.urlsplit(self.url)
        return urllib.parse.urlunsplit(parts._replace(scheme=self.scheme))

    def redacted(self) -> str:
        """The URL with any password replaced by ***: what logs and metrics may show."""
        return redact(self.url)

    def client_kwargs(self) -> dict:
        out: dict = {}
        if self.password is not None:
            out["password"] = self.password
        if self.scheme == "rediss":
            out["ssl_cert_reqs"] = "required"
            if self.tls_ca:
                out["ssl_ca_certs"] = self.tls_ca
            if self.tls_cert:
                out["ssl_certfile"], out["ssl_keyfile"] = self.tls_cert, self.tls_key
        return out

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


def redact(url: str) -> str:
    """`url` with its password (if any) replaced by ***."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def add_redis_flags(parser: argparse.ArgumentParser, url_help: str, mac_key: bool = False) -> None:
    """--redis-url, --redis-cluster, --redis-password-file, --redis-tls-ca/-cert/-key, and with
    `mac_key` --l3-mac-key-file (the service that writes and loads pages); `settings_from_args`
    reads them."""
    add_flag(parser, "--redis-url", "REDIS_URL", "", url_help + ": redis://[user[:password]@]"
             "host:port/db, rediss:// for TLS, redis+cluster:// (rediss+cluster://) for a Redis "
             "Cluster (any node); empty = no L3")
    parser.add_argument("--redis-cluster", action=argparse.BooleanOptionalAction,
                        default=env_bool("REDIS_CLUSTER"),
                        help="--redis-url names a node of a Redis Cluster (as a +cluster scheme "
                             "does) (env PREFIXCACHE_REDIS_CLUSTER=1/0; default off)")
    add_flag(parser, "--redis-password-file", "REDIS_PASSWORD_FILE", None,
             "file holding the Redis (ACL) password; the user name is the URL's (redis://USER@"
             "host)")
    add_flag(parser, "--redis-tls-ca", "REDIS_TLS_CA", None,
             "PEM CA bundle the rediss:// server certificate is verified against")
    add_flag(parser, "--redis-tls-cert", "REDIS_TLS_CERT", None,
             "PEM client certificate for a Redis that requires one (with --redis-tls-key)")
    add_flag(parser, "--redis-tls-key", "REDIS_TLS_KEY", None, "PEM key of --redis-tls-cert")
    if mac_key:
        add_flag(parser, "--l3-mac-key-file", "L3_MAC_KEY_FILE", None,
                 "file holding the key (16+ bytes, a Secret) of the MAC every L3 page carries: "
                 "pages are written with it and loaded only when their MAC matches (every "
                 "worker has the same); without one pages are only checksummed and anyone who "
                 "can write to Redis can change outputs (a warning at start)")


def env_bool(name: str) -> bool | None:
    """$PREFIXCACHE_<name> as a boolean (1/true/yes/on, 0/false/no/off), None when unset."""
    value = os.environ.get(f"PREFIXCACHE_{name}")
    if value is None:
        return None
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise SystemExit(f"PREFIXCACHE_{name}={value!r}: expected 1/0, true/false, yes/no or on/off")


def settings_from_args(parser: argparse.ArgumentParser,
                       args: argparse.Namespace) -> RedisSettings | None:
    """The Redis flags as settings (None without --redis-url), and the MAC key read from
    --l3-mac-key-file as `args.l3_mac_key` (None without); an inconsistent set is a usage error
    naming the flag."""
    args.l3_mac_key = None
    if not args.redis_url:
        for name in ("redis_password_file", "redis_tls_ca", "redis_tls_cert", "redis_tls_key",
                     "l3_mac_key_file"):
            if getattr(args, name, None):
                parser.error(f"--{name.replace('_', '-')} needs --redis-url")
        return None
    if getattr(args, "l3_mac_key_file", None):
        try:
            args.l3_mac_key = read_key_file(args.l3_mac_key_file, "--l3-mac-key-file")
        except ValueError as exc:
            parser.error(str(exc))
    try:
        return RedisSettings(args.redis_url, cluster=bool(args.redis_cluster),
                             password_file=args.redis_password_file, tls_ca=args.redis_tls_ca,
                             tls_cert=args.redis_tls_cert, tls_key=args.redis_tls_key)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def read_key_file(path: str, flag: str) -> bytes:
    """A secret key from a file (a mounted Secret): its bytes, stripped of surrounding
    whitespace; at least 16 bytes, so a placeholder or an empty file is refused."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    key = p.read_bytes().strip()
    if len(key) < 16:
        raise ValueError(f"{flag} {path}: {len(key)} bytes, a key needs at least 16")
    return key
