"""The command-line side of service authentication: --service-identities-file for servers
(service_shell/auth.py) and --service-token-file for clients (service_shell/service_token.py),
each falling back to its PREFIXCACHE_* variable."""
from __future__ import annotations

import argparse

from service_shell.auth import ServiceIdentities
from service_shell.config import add_flag
from service_shell.service_token import SERVICE_TOKEN_METADATA_KEY, read_token


def add_identities_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    add_flag(parser, "--service-identities-file", "SERVICE_IDENTITIES_FILE", None,
             help or "JSON file of the service identities allowed to call this server, with "
             "their roles (service_shell/auth.py); unset = no service authentication (logged as "
             "event=auth_disabled)")


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
