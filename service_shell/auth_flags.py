"""The command-line side of service authentication: --service-identities-file for servers
(service_shell/auth.py) and --service-token-file for clients (service_shell/service_token.py),
each falling back to its PREFIXCACHE_* variable; and --allow-unauthenticated-network, without
which a server with no identities file serves loopback only (issue 25: the cache and compute
services listened on every interface with auth off by default)."""
from __future__ import annotations

import argparse
import ipaddress

from service_shell.auth import ServiceIdentities
from service_shell.config import add_bool_flag, add_flag

ALLOW_NETWORK_FLAG = "--allow-unauthenticated-network (PREFIXCACHE_ALLOW_UNAUTHENTICATED_NETWORK)"
from service_shell.service_token import SERVICE_TOKEN_METADATA_KEY, read_token


def add_identities_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    add_flag(parser, "--service-identities-file", "SERVICE_IDENTITIES_FILE", None,
             help or "JSON file of the service identities allowed to call this server, with "
             "their roles (service_shell/auth.py); unset = no service authentication (logged as "
             "event=auth_disabled)")


def add_network_flag(parser: argparse.ArgumentParser) -> None:
    add_bool_flag(parser, "--allow-unauthenticated-network", "ALLOW_UNAUTHENTICATED_NETWORK",
                  "serve on a --host other than loopback without --service-identities-file: "
                  "anyone who reaches the port may call every RPC", "off: refused at start")


def is_loopback(host: str) -> bool:
    """`host` (as --host takes it: an address, [v6], or a name) reaches this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_network_exposure(parser: argparse.ArgumentParser, args: argparse.Namespace,
                           identities: ServiceIdentities | None) -> None:
    """A usage error when the server would serve a non-loopback address with auth off, unless
    --allow-unauthenticated-network says so."""
    if identities is not None or is_loopback(args.host) or args.allow_unauthenticated_network:
        return
    parser.error(f"--host {args.host}: not a loopback address, and no --service-identities-file "
                 "(PREFIXCACHE_SERVICE_IDENTITIES_FILE): anyone who reaches the port could call "
                 "every RPC. Give an identities file, bind 127.0.0.1, or pass "
                 f"{ALLOW_NETWORK_FLAG}")


def add_token_flag(parser: argparse.ArgumentParser, *, to: str) -> None:
    add_flag(parser, "--service-token-file", "SERVICE_TOKEN_FILE", None,
             f"file holding this process's service token, sent to {to} as "
             f"{SERVICE_TOKEN_METADATA_KEY} metadata; unset = none sent")


def identities_from_args(parser: argparse.ArgumentParser,
                         args: argparse.Namespace) -> ServiceIdentities | None:
    """The identities file as flags name it; a bad file is a usage error naming entry and field."""
    if not args.service_identities_file:
        return None
    try:
        return ServiceIdentities.from_file(args.service_identities_file)
    except ValueError as exc:
        parser.error(str(exc))


def token_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    try:
        return read_token(args.service_token_file)
    except ValueError as exc:
        parser.error(str(exc))
