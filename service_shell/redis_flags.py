"""The Redis flags both services take, turned into `pagestore.RedisSettings` (the L3 page store's
settings; pagestore itself reads no flag and no environment variable).

    --redis-url           redis://[user[:password]@]host:port/db, rediss:// for TLS,
                          redis+cluster://host:port (or rediss+cluster://) for a Redis Cluster:
                          any node; the client learns the others from it
    --redis-cluster       the same as a +cluster scheme, for URLs given as redis://
    --redis-password-file the ACL password, read from a file (a mounted Secret), so that it is
                          on no command line and in no environment listing; the URL's user name
                          (redis://USER@host) goes with it
    --redis-tls-ca/-cert/-key  PEM files: the CA Redis's certificate is checked against, and a
                          client certificate for a Redis that requires one (tls-auth-clients)
    --l3-mac-key-file     (the compute service) the key of the page MAC

Imported by the cache service and the compute service only (it needs pagestore, hence redis-py;
the gateway and the torch-free clients never import it, so service_shell's package does not
re-export it).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pagestore.settings import RedisSettings
from service_shell.config import add_bool_flag, add_flag


def add_redis_flags(parser: argparse.ArgumentParser, url_help: str, mac_key: bool = False) -> None:
    """--redis-url, --redis-cluster, --redis-password-file, --redis-tls-ca/-cert/-key, and with
    `mac_key` --l3-mac-key-file (the service that writes and loads pages); `settings_from_args`
    reads them."""
    add_flag(parser, "--redis-url", "REDIS_URL", "", url_help + ": redis://[user[:password]@]"
             "host:port/db, rediss:// for TLS, redis+cluster:// (rediss+cluster://) for a Redis "
             "Cluster (any node); empty = no L3")
    add_bool_flag(parser, "--redis-cluster", "REDIS_CLUSTER",
                  "--redis-url names a node of a Redis Cluster (as a +cluster scheme does)", "off")
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
