"""TLS and mutual TLS from PEM files, the one place where credentials are built.

Settings (flags and PREFIXCACHE_* variables, see `flags.add_tls_flags`):
- cert + key (PREFIXCACHE_TLS_CERT, PREFIXCACHE_TLS_KEY): a server serves TLS with them; a client
  presents them as its client certificate.
- ca (PREFIXCACHE_TLS_CA): a server requires a client certificate signed by it (mTLS); a client
  verifies the server against it (without it, against the system's roots).
- server_name (PREFIXCACHE_TLS_SERVER_NAME): the name a client checks the server's certificate
  against instead of the target's host, for servers dialed by IP (pods) that no certificate names.

Only the main gRPC port uses TLS. The dedicated health port (`health.HealthPort`) and the metrics
endpoint stay plaintext on purpose: kubelet `grpc:` probes and most Prometheus setups cannot
present a client certificate, and both expose nothing but status and counters.

Files are read when credentials are built (server start, client construction), so a renewed
certificate takes effect when the process restarts.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

# field -> (flag, environment variable), for messages that tell the operator what to fix.
SETTINGS = {"cert": ("--tls-cert", "PREFIXCACHE_TLS_CERT"),
            "key": ("--tls-key", "PREFIXCACHE_TLS_KEY"),
            "ca": ("--tls-ca", "PREFIXCACHE_TLS_CA"),
            "server_name": ("--tls-server-name", "PREFIXCACHE_TLS_SERVER_NAME")}


def _name(field: str) -> str:
    flag, env = SETTINGS[field]
    return f"{flag} ({env})"


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Paths of PEM files (None = not set); see the module's docstring for what each one does."""
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"{_name('cert')} and {_name('key')} must be set together")

    @classmethod
    def from_values(cls, **values: str | None) -> TlsConfig | None:
        """A config from settings where "" means not set; None when none is set (plaintext)."""
        cleaned = {k: v for k, v in values.items() if v}
        return cls(**cleaned) if cleaned else None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TlsConfig | None:
        """From the PREFIXCACHE_TLS_* variables, for programs without flags."""
        env = os.environ if environ is None else environ
        return cls.from_values(**{f: env.get(var) for f, (_, var) in SETTINGS.items()})

    @classmethod
    def from_args(cls, args: object) -> TlsConfig | None:
        """From the flags `flags.add_tls_flags` added (which fall back to the variables)."""
        return cls.from_values(**{f: getattr(args, f"tls_{f}") for f in SETTINGS})

    @property
    def mutual(self) -> bool:
        """Whether a server with this config requires client certificates."""
        return self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError(f"a TLS server needs {_name('cert')} and {_name('key')}; "
                             f"{_name('ca')} alone only configures clients")
        return grpc.ssl_server_credentials(
            [(_read("key", self.key), _read("cert", self.cert))],
            root_certificates=_read("ca", self.ca) if self.ca else None,
            require_client_auth=self.mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read("ca", self.ca) if self.ca else None,
            private_key=_read("key", self.key) if self.key else None,
            certificate_chain=_read("cert", self.cert) if self.cert else None)

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def _read(field: str, path: str) -> bytes:
    """The file's bytes; errors name the setting, since gRPC's own ("handshake failed") do not."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise OSError(f"{_name(field)}: cannot read {path}: {exc.strerror}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{_name(field)}: {path} is not a PEM file")
    return data


def open_channel(target: str, options: Sequence[tuple[str, int | str]], *,
                 tls: TlsConfig | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to `target`: TLS from `tls` (files) or `credentials` (built by the caller),
    plaintext when neither is given."""
    if tls is not None:
        if credentials is not None:
            raise ValueError("pass tls or credentials, not both")
        credentials = tls.channel_credentials()
        options = [*options, *tls.channel_options()]
    if credentials is None:
        return grpc.insecure_channel(target, list(options))
    return grpc.secure_channel(target, credentials, list(options))


def tls_mode(tls: TlsConfig | None) -> str:
    """How a server with this config serves, for its startup log line: plaintext, tls, mtls."""
    if tls is None or tls.cert is None:
        return "plaintext"
    return "mtls" if tls.mutual else "tls"
