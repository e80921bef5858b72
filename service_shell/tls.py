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

A server re-reads its files when they change: gRPC asks `_ServerCertificates` before every new
connection's handshake, so a renewed certificate (cert-manager rewrites the Secret's files) serves
the next connection without a restart, and connections already open keep theirs. A half-written
or mismatched set (a key that is not the certificate's) is refused with a `tls_reload_failed` log
line, and the server keeps what it had. The gateway's HTTP port (uvicorn, an `ssl.SSLContext`)
does the same through `SslContextReloader`, loading a renewed set into the context it serves
with. A client reads its files when it is constructed (its
channels keep those credentials), so a renewed client certificate takes effect on restart.
"""
from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from service_shell.config import env_text
from service_shell.service_token import with_service_token
from service_shell.logs import kv

log = logging.getLogger("service_shell.tls")

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
        return cls.from_values(**{f: env_text(var, environ) for f, (_, var) in SETTINGS.items()})

    @classmethod
    def from_args(cls, args: object) -> TlsConfig | None:
        """From the flags `flags.add_tls_flags` added (which fall back to the variables)."""
        return cls.from_values(**{f: getattr(args, f"tls_{f}") for f in SETTINGS})

    @property
    def mutual(self) -> bool:
        """Whether a server with this config requires client certificates."""
        return self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that serve the files' current contents (see the module's docstring)."""
        if self.cert is None or self.key is None:
            raise ValueError(f"a TLS server needs {_name('cert')} and {_name('key')}; "
                             f"{_name('ca')} alone only configures clients")
        certificates = _ServerCertificates(self)
        return grpc.dynamic_ssl_server_credentials(certificates.initial, certificates.fetch,
                                                   require_client_authentication=self.mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read("ca", self.ca) if self.ca else None,
            private_key=_read("key", self.key) if self.key else None,
            certificate_chain=_read("cert", self.cert) if self.cert else None)

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


class _ServerCertificates:
    """A server's key, certificate and CA, re-read when one of the files changes.

    `fetch` runs on gRPC's threads before each handshake: it costs a stat of each file, and a
    read and check only after a change. A new set is used only when it loads as a TLS server
    would load it (the key is the certificate's, the CA parses), and the bytes checked are the
    bytes served (the files are read again after the check and must not have moved)."""

    def __init__(self, tls: TlsConfig) -> None:
        self._files = {"key": tls.key, "cert": tls.cert, **({"ca": tls.ca} if tls.ca else {})}
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self.initial = self._load()  # raises, naming the setting, when the files are unusable

    def _stat(self) -> tuple:
        stamp = []
        for path in self._files.values():
            try:
                st = os.stat(path)
                stamp.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                stamp.append(None)
        return tuple(stamp)

    def _read_all(self) -> dict[str, bytes]:
        return {field: _read(field, path) for field, path in self._files.items()}

    def _load(self) -> grpc.ServerCertificateConfiguration:
        data = self._read_all()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self._files["cert"], self._files["key"])
            if "ca" in data:
                context.load_verify_locations(cadata=data["ca"].decode("ascii", "replace"))
        except ssl.SSLError as exc:
            raise ValueError(f"{_name('cert')}, {_name('key')}"
                             f"{', ' + _name('ca') if 'ca' in data else ''}: not a usable set: "
                             f"{exc.reason or exc}") from exc
        if self._read_all() != data:
            raise ValueError("the files changed while they were being loaded")
        return grpc.ssl_server_certificate_configuration([(data["key"], data["cert"])],
                                                         root_certificates=data.get("ca"))

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed and load cleanly, else None (no change)."""
        with self._lock:
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            self._stamp = stamp  # a failed set is reported once, and retried on its next change
            try:
                config = self._load()
            except (OSError, ValueError) as exc:
                log.warning(kv("tls_reload_failed", keeping="the previous certificate", error=exc))
                return None
            log.info(kv("tls_certificate_reloaded", cert=self._files["cert"]))
            return config


class SslContextReloader:
    """`_ServerCertificates` for an `ssl.SSLContext` (the HTTP port's): `check(context)` loads
    a changed set that loads cleanly into `context` itself, which keeps serving the old set
    otherwise. Call it from the thread that runs the context's handshakes (the event loop). A
    new CA is added to the ones trusted (OpenSSL cannot drop one from a live context)."""

    def __init__(self, tls: TlsConfig) -> None:
        self._tls = tls
        self._certificates = _ServerCertificates(tls)

    def check(self, context: ssl.SSLContext) -> bool:
        if self._certificates.fetch() is None:
            return False
        try:
            context.load_cert_chain(self._tls.cert, self._tls.key)
            if self._tls.ca:
                context.load_verify_locations(self._tls.ca)
        except (OSError, ssl.SSLError) as exc:  # the files moved again since the check
            log.warning(kv("tls_reload_failed", port="http", error=exc))
            return False
        return True


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
                 credentials: grpc.ChannelCredentials | None = None,
                 service_token: str | None = None) -> grpc.Channel:
    """A channel to `target`: TLS from `tls` (files) or `credentials` (built by the caller),
    plaintext when neither is given; `service_token` goes with every call (service_shell/auth.py)."""
    if tls is not None:
        if credentials is not None:
            raise ValueError("pass tls or credentials, not both")
        credentials = tls.channel_credentials()
        options = [*options, *tls.channel_options()]
    if credentials is None:
        return with_service_token(grpc.insecure_channel(target, list(options)), service_token)
    return with_service_token(grpc.secure_channel(target, credentials, list(options)),
                              service_token)


def tls_mode(tls: TlsConfig | None) -> str:
    """How a server with this config serves, for its startup log line: plaintext, tls, mtls."""
    if tls is None or tls.cert is None:
        return "plaintext"
    return "mtls" if tls.mutual else "tls"
