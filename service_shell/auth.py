"""Service-to-service authentication and per-RPC authorization (design.md §8, "Service
identities").

The gateway authenticates tenants (gateway/core/tenants.py); this module authenticates the services
behind it. A server started with a service-identities file (--service-identities-file,
PREFIXCACHE_SERVICE_IDENTITIES_FILE, a mounted Secret in Kubernetes) refuses every call of its
service from a caller that is not in the file (UNAUTHENTICATED), and every call whose RPC the
caller's role may not make (PERMISSION_DENIED). The file:

    {"identities": [
      {"name": "gateway", "role": "gateway", "token_sha256": "<hex of sha256(token)>"},
      {"name": "worker", "role": "worker", "token": "<token>", "pools": ["worker-*"]},
      {"name": "ops", "role": "operator", "certificate_names": ["ops.prefixcache.internal"]}
    ]}

A caller presents its token as `x-prefixcache-service-token` call metadata (not `authorization`,
which carries tenant tokens at the gateway), read from --service-token-file
(PREFIXCACHE_SERVICE_TOKEN_FILE; the client side is service_shell/service_token.py, the flags
service_shell/auth_flags.py); or, on an mTLS port, a client certificate whose common name
or DNS/URI subject alternative name is one of an identity's `certificate_names` (a certificate
of the CA alone is not an identity). Tokens are looked up by SHA-256 digest, like tenant tokens,
and the file may hold only digests (`token_sha256`), so it need not contain a usable secret.

Roles and what they may call (`CACHE_POLICY`, `COMPUTE_POLICY`): the gateway Generates and
follows event streams; a worker drives its own pool (pool ownership: cache_service/access.py);
a subscriber reads (Subscribe, GetStats, ListPools, GetModelInfo, GetTokenizer); an operator may
also register and unregister any pool, evict namespaces and load and unload adapters; the data
plane (Envoy behind the Endpoint Picker) may only forward Generate and Abort to workers and call
the EPP (`EPP_POLICY`). Health
and reflection stay open (probes cannot present credentials; reflection shows only the schema).

Without an identities file the server logs `event=auth_disabled` at WARNING and serves anyone,
as before (local development, the test suite), on loopback only unless
--allow-unauthenticated-network (service_shell/auth_flags.py); the manifests always mount one.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import prometheus_client

from service_shell.logs import kv
from service_shell.service_token import SERVICE_TOKEN_METADATA_KEY

log = logging.getLogger("service_shell.auth")

GATEWAY, WORKER, OPERATOR, SUBSCRIBER = "gateway", "worker", "operator", "subscriber"
# The data plane (Envoy behind the Endpoint Picker, gateway/epp/): it forwards a tenant's
# Generate (and Abort of it) to the worker the EPP picked, and calls the EPP itself; nothing
# else. Its token is Envoy's own (a static header Envoy adds), never one the EPP hands out.
DATAPLANE = "dataplane"
ROLES = (GATEWAY, WORKER, OPERATOR, SUBSCRIBER, DATAPLANE)
_READERS = frozenset({GATEWAY, WORKER, OPERATOR, SUBSCRIBER})

# RPC -> roles allowed to call it, per service. An RPC missing from its service's table is
# refused to everyone (a new RPC must be added here to be callable with auth on). Worker calls
# on a pool are further limited to pools the worker owns (cache_service/access.py).
CACHE_POLICY: Mapping[str, frozenset[str]] = {
    "RegisterPool": frozenset({WORKER, OPERATOR}),
    "UnregisterPool": frozenset({WORKER, OPERATOR}),
    "Step": frozenset({WORKER}),
    "EvictNamespace": frozenset({WORKER, OPERATOR}),
    "ListPools": _READERS,
    "GetStats": _READERS,
    "Subscribe": frozenset({GATEWAY, SUBSCRIBER, OPERATOR}),
}
COMPUTE_POLICY: Mapping[str, frozenset[str]] = {
    "Generate": frozenset({GATEWAY, OPERATOR, DATAPLANE}),
    # The data plane's Aborts are scoped to the tenant the EPP authenticated (the request
    # scope header, compute_service/request_scope.py), as the gateway's are.
    "Abort": frozenset({GATEWAY, OPERATOR, DATAPLANE}),
    "GetModelInfo": frozenset({GATEWAY, OPERATOR, SUBSCRIBER}),
    "GetTokenizer": frozenset({GATEWAY, OPERATOR, SUBSCRIBER}),
    "LoadAdapter": frozenset({OPERATOR}),
    "UnloadAdapter": frozenset({OPERATOR}),
}
# The gateway's Endpoint Picker port (gateway/epp/server.py): only the data plane may ask it.
EPP_POLICY: Mapping[str, frozenset[str]] = {"Process": frozenset({DATAPLANE})}

IDENTITIES_FLAG = "--service-identities-file (PREFIXCACHE_SERVICE_IDENTITIES_FILE)"
_CERT_KEYS = ("x509_common_name", "x509_subject_alternative_name")


class AuthError(Exception):
    """A refused call: `code` (UNAUTHENTICATED / PERMISSION_DENIED / RESOURCE_EXHAUSTED),
    `reason` (the metric's label) and a message that says what to fix."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller. `pools`: patterns (exact, or a prefix ending in '*') of the
    pools a worker may drive; None = any pool it registers first."""
    name: str
    role: str
    pools: tuple[str, ...] | None = None

    def may_use_pool(self, pool_id: str) -> bool:
        if self.pools is None:
            return True
        return any(pool_id == p or (p.endswith("*") and pool_id.startswith(p[:-1]))
                   for p in self.pools)


def token_digest(token: str) -> bytes:
    """What a bearer token is looked up by (service identities here, tenants at the gateway):
    no plaintext secret kept in memory, and a dict probe on a fixed-length digest leaks nothing
    useful through timing."""
    return hashlib.sha256(token.encode()).digest()


class ServiceIdentities:
    """Token digests and certificate names -> identities, from the identities file."""

    def __init__(self, tokens: Mapping[bytes, Identity] | None = None,
                 certificates: Mapping[str, Identity] | None = None) -> None:
        self._tokens = dict(tokens or {})
        self._certificates = dict(certificates or {})

    def __len__(self) -> int:
        return len({*self._tokens.values(), *self._certificates.values()})

    @classmethod
    def from_file(cls, path: str | Path) -> ServiceIdentities:
        """Reads and validates the file; ValueError names the flag, the entry and the field
        (never a token)."""
        where = f"{IDENTITIES_FLAG} {path}"
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        entries = data.get("identities") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{where}: expected {{\"identities\": [{{\"name\": NAME, "
                             f"\"role\": ROLE, \"token_sha256\" | \"token\" | "
                             f"\"certificate_names\": ...}}]}}")
        tokens: dict[bytes, Identity] = {}
        certificates: dict[str, Identity] = {}
        for i, entry in enumerate(entries):
            at = f"{where}: identities[{i}]"
            identity, digests, names = _parse_entry(entry, at)
            for digest in digests:
                if digest in tokens:
                    raise ValueError(f"{at}: its token is also another identity's")
                tokens[digest] = identity
            for name in names:
                if name in certificates:
                    raise ValueError(f"{at}.certificate_names: {name!r} is also another's")
                certificates[name] = identity
        return cls(tokens, certificates)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None,
                     auth_context: Mapping[str, list[bytes]] | Callable[[], Mapping] | None = None
                     ) -> Identity:
        """The caller's identity: its token when it sent one, else its client certificate's
        names (`auth_context`, or a function returning it: read only when no token came).
        AuthError (UNAUTHENTICATED) otherwise."""
        values = [v for k, v in metadata or () if k == SERVICE_TOKEN_METADATA_KEY]
        if len(values) > 1:
            raise _unauthenticated("duplicate_token", f"{SERVICE_TOKEN_METADATA_KEY}: sent "
                                   f"{len(values)} times; send one")
        if values:
            value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
            found = _lookup(self._tokens, token_digest(value.strip()))
            if found is None:
                raise _unauthenticated("unknown_token", f"{SERVICE_TOKEN_METADATA_KEY}: unknown "
                                       f"service token (not in the server's {IDENTITIES_FLAG})")
            return found
        if callable(auth_context):
            auth_context = auth_context()
        names = [n.decode(errors="replace") for key in _CERT_KEYS
                 for n in (auth_context or {}).get(key, ())]
        for name in names:
            found = self._certificates.get(name)
            if found is not None:
                return found
        if names:
            raise _unauthenticated("unknown_certificate",
                                   f"client certificate {names[0]!r} is not an identity of this "
                                   f"server's {IDENTITIES_FLAG}; send {SERVICE_TOKEN_METADATA_KEY}")
        raise _unauthenticated("missing_credentials",
                               f"{SERVICE_TOKEN_METADATA_KEY}: missing; this service requires a "
                               f"service token (or a client certificate named in its identities "
                               f"file)")


def _parse_entry(entry: object, at: str) -> tuple[Identity, list[bytes], list[str]]:
    if not isinstance(entry, dict):
        raise ValueError(f"{at}: must be an object")
    name, role = entry.get("name"), entry.get("role")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{at}.name: must be a non-empty string")
    if role not in ROLES:
        raise ValueError(f"{at}.role: must be one of {', '.join(ROLES)}, got {role!r}")
    digests = []
    token, hexdigest = entry.get("token"), entry.get("token_sha256")
    if token is not None:
        if not isinstance(token, str) or len(token) < 16:
            raise ValueError(f"{at}.token: must be a string of at least 16 characters")
        digests.append(token_digest(token))
    if hexdigest is not None:
        try:
            digest = bytes.fromhex(hexdigest)
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{at}.token_sha256: must be 64 hex digits (sha256 of the token)")
        digests.append(digest)
    names = entry.get("certificate_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{at}.certificate_names: must be a list of non-empty strings")
    if not digests and not names:
        raise ValueError(f"{at}: needs token_sha256, token or certificate_names")
    pools = entry.get("pools")
    if pools is not None and (not isinstance(pools, list) or
                              not all(isinstance(p, str) and p for p in pools)):
        raise ValueError(f"{at}.pools: must be a list of pool ids (a trailing '*' is a prefix)")
    return Identity(name, role, tuple(pools) if pools is not None else None), digests, names


def _lookup(tokens: Mapping[bytes, Identity], digest: bytes) -> Identity | None:
    # A dict probe on a fixed-length digest of the secret leaks nothing useful through timing
    # (as with tenant tokens, gateway/core/tenants.py).
    return tokens.get(digest)


def _unauthenticated(reason: str, message: str) -> AuthError:
    return AuthError(grpc.StatusCode.UNAUTHENTICATED, reason, message)


class Refusals:
    """`prefixcache_service_auth_refusals_total{rpc, reason}` in a server's registry, and the
    log line of each refusal."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, service: str) -> None:
        self._service = service
        self._counter = prometheus_client.Counter(
            "prefixcache_service_auth_refusals", "Calls refused by service authentication, "
            "authorization or per-identity limits, by RPC and reason.", ["rpc", "reason"],
            registry=registry)

    def refuse(self, context: grpc.ServicerContext, rpc: str, error: AuthError,
               identity: Identity | None = None) -> None:
        """Counts, logs and aborts the call (raises)."""
        self._counter.labels(rpc, error.reason).inc()
        log.warning(kv("rpc_refused", service=self._service, rpc=rpc, code=error.code.name,
                       reason=error.reason, identity=identity.name if identity else None,
                       peer=context.peer()))
        context.abort(error.code, error.message)


class _AuthedContext:
    """The servicer's context with the caller's `identity` attached (everything else is the
    real context's)."""

    def __init__(self, context: grpc.ServicerContext, identity: Identity) -> None:
        self._context = context
        self.identity = identity

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def identity_of(context: object) -> Identity | None:
    """The authenticated caller of a call; None when the server runs without auth."""
    return getattr(context, "identity", None)


class AuthInterceptor(grpc.ServerInterceptor):
    """Authenticates and authorizes every call of `service` (full proto name) by `policy`;
    other services (health, reflection) pass through."""

    def __init__(self, identities: ServiceIdentities, service: str,
                 policy: Mapping[str, frozenset[str]], refusals: Refusals) -> None:
        self._identities, self._policy, self._refusals = identities, policy, refusals
        self._prefix = f"/{service}/"
        # method -> (the service's handler, its checked wrapper): gRPC asks for the handler on
        # every call, and wrapping it anew each time would cost every Step.
        self._wrapped: dict[str, tuple[object, grpc.RpcMethodHandler]] = {}

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or not method.startswith(self._prefix):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method[len(self._prefix):], handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, rpc: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        allowed = self._policy.get(rpc, frozenset())
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(rpc, allowed, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(rpc, allowed, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:  # the EPP's ext_proc Process
            return grpc.stream_stream_rpc_method_handler(
                self._stream(rpc, allowed, handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        # No client-streaming RPC exists in these services; refuse rather than pass unchecked.
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                                   f"{rpc}: not callable with auth on"))

    def _check(self, rpc: str, allowed: frozenset[str], context) -> _AuthedContext:
        try:
            identity = self._identities.authenticate(context.invocation_metadata(),
                                                     context.auth_context)
        except AuthError as exc:
            self._refusals.refuse(context, rpc, exc)
        if identity.role not in allowed:
            who = ", ".join(sorted(allowed)) or "no role"
            self._refusals.refuse(context, rpc, AuthError(
                grpc.StatusCode.PERMISSION_DENIED, "role",
                f"{rpc}: identity '{identity.name}' (role {identity.role}) may not call it; "
                f"allowed: {who}"), identity)
        return _AuthedContext(context, identity)

    def _unary(self, rpc: str, allowed: frozenset[str], behavior: Callable):
        def call(request, context):
            return behavior(request, self._check(rpc, allowed, context))
        return call

    def _stream(self, rpc: str, allowed: frozenset[str], behavior: Callable):
        def call(request, context):
            # Checked before the first message, not when the first item is pulled: the handler
            # is a generator, so the check must run in this function's own body.
            authed = self._check(rpc, allowed, context)
            return behavior(request, authed)
        return call


def interceptors(identities: ServiceIdentities | None, service: str,
                 policy: Mapping[str, frozenset[str]],
                 registry: prometheus_client.CollectorRegistry
                 ) -> tuple[tuple[grpc.ServerInterceptor, ...], Refusals]:
    """The server's auth interceptor (none without identities: auth off, logged loudly) and its
    refusal counter (which the servicer also uses for its own checks)."""
    refusals = Refusals(registry, service)
    if identities is None:
        log.warning(kv("auth_disabled", service=service, risk="any caller that reaches the port "
                       "may call every RPC", fix=f"start with {IDENTITIES_FLAG}"))
        return (), refusals
    log.info(kv("auth_enabled", service=service, identities=len(identities)))
    return (AuthInterceptor(identities, service, policy, refusals),), refusals
