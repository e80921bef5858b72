"""A Redis URL with its ACL password file and TLS files: the checks they must pass, the password
read from its file, redis-py's keyword arguments for them, and the URL as logs may show it.

Shared by the services' L3 connection (`pagestore.settings.RedisSettings`, flags --redis-*) and
the gateway's shared routing index (`gateway.core.index_redis.IndexRedis`, flags
--index-redis-*): the gateway image holds no pagestore, and both accept the same URL forms:

    redis://[user[:password]@]host:port/db, rediss:// for TLS, unix:// for a socket,
    redis+cluster://host:port (rediss+cluster://) for a Redis Cluster: any node
"""
from __future__ import annotations

import urllib.parse
from pathlib import Path

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)


def url_scheme(url: str) -> str:
    """The URL's scheme as given (a +cluster suffix kept)."""
    return urllib.parse.urlsplit(url).scheme


def base_scheme(url: str) -> str:
    """redis, rediss or unix: the URL's scheme without a +cluster suffix."""
    scheme = url_scheme(url)
    return CLUSTER_SCHEMES.get(scheme, scheme)


def plain_url(url: str) -> str:
    """The URL redis-py parses: the scheme without +cluster."""
    return urllib.parse.urlunsplit(urllib.parse.urlsplit(url)._replace(scheme=base_scheme(url)))


def check_scheme(url: str, flag: str) -> None:
    """Raises ValueError naming `flag` (the URL's flag) unless the scheme is one of SCHEMES."""
    scheme = url_scheme(url)
    if scheme not in SCHEMES:
        raise ValueError(f"{flag}: scheme {scheme!r} is not one of {', '.join(SCHEMES)}")


def checked_password(url: str, password_file: str | None, password: str | None,
                     tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
                     prefix: str) -> str | None:
    """Checks the TLS files and the password file against the URL (ValueError naming the flags
    `prefix`-url, `prefix`-password-file, `prefix`-tls-ca/-cert/-key); the password: `password`
    when given, else the one read from the file, else None."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError(f"{prefix}-tls-cert and {prefix}-tls-key go together")
    if (tls_ca or tls_cert) and base_scheme(url) != "rediss":
        raise ValueError(f"{prefix}-tls-ca/{prefix}-tls-cert need a rediss:// (TLS) {prefix}-url")
    if password_file and urllib.parse.urlsplit(url).password:
        raise ValueError(f"{prefix}-password-file: the {prefix}-url holds a password already; "
                         "give it in one place")
    if password_file and password is None:
        path = Path(password_file)
        if not path.is_file():
            raise ValueError(f"{prefix}-password-file {password_file}: no such file")
        return path.read_text().strip()
    return password


def auth_kwargs(url: str, password: str | None, tls_ca: str | None, tls_cert: str | None,
                tls_key: str | None) -> dict:
    """redis-py's keyword arguments for the password and, over rediss://, the TLS files (the
    server's certificate is always verified)."""
    out: dict = {}
    if password is not None:
        out["password"] = password
    if base_scheme(url) == "rediss":
        out["ssl_cert_reqs"] = "required"
        if tls_ca:
            out["ssl_ca_certs"] = tls_ca
        if tls_cert:
            out["ssl_certfile"], out["ssl_keyfile"] = tls_cert, tls_key
    return out


def redact(url: str) -> str:
    """`url` with its password (if any) replaced by ***."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
