"""Throwaway service identities for a local stack (design.md §8, "Service identities"): a token
per service, written to the run directory (mode 0600), and the identities file the cache
service and the workers check them against, which holds only their SHA-256 digests. Each worker
may use only its own pool; the operator token is for the person at the keyboard (grpcurl,
examples/), printed by --keep-running."""
from __future__ import annotations

import json
import os
import pathlib
import secrets
from dataclasses import dataclass

from service_shell.auth import token_digest


@dataclass(frozen=True, slots=True)
class StackCredentials:
    identities: pathlib.Path
    tokens: dict[str, pathlib.Path]  # identity name -> its token file


def write_credentials(run_dir: pathlib.Path, workers: list[str]) -> StackCredentials:
    """Tokens for the gateway, an operator and each worker (named after its pool)."""
    directory = run_dir / "service-auth"
    directory.mkdir(mode=0o700, exist_ok=True)
    roles = {"gateway": "gateway", "operator": "operator", **{w: "worker" for w in workers}}
    entries, tokens = [], {}
    for name, role in roles.items():
        token = secrets.token_urlsafe(32)
        path = directory / f"{name}.token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        tokens[name] = path
        entry = {"name": name, "role": role,
                 "token_sha256": token_digest(token).hex()}
        if role == "worker":
            entry["pools"] = [name]
        entries.append(entry)
    identities = directory / "service-identities.json"
    identities.write_text(json.dumps({"identities": entries}, indent=2))
    return StackCredentials(identities, tokens)
