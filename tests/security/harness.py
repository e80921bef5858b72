"""The security suite's fixtures' building blocks: an identities file with one identity per role,
a cache service with auth on and a victim worker's pool on it (registered over gRPC under the
worker's token, so the worker owns it, with a tenant's salted prompt cached), stubs that present
a token (or none), and the assertion every attack test ends with: refused with this code."""
from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from cache_service.access import CacheLimits
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import cache_service_pb2_grpc as pb_grpc
from prefixcache.v1 import common_pb2
from service_shell.auth import ServiceIdentities
from service_shell.service_token import with_service_token
from tests.cache_service.grpc_harness import running_server

PAGE = 16
MODEL = "test-model"
VICTIM_POOL = "worker-1"
VICTIM_SALT = "salt-of-tenant-alice"
# 368 tokens (23 pages), the cached prefix the probe read back with a known salt.
VICTIM_PROMPT = [(7 * i + 3) % 1000 for i in range(23 * PAGE + 1)]
DEVICE_PAGES = 512

TOKENS = {"gateway": "gateway-token-0123456789", "worker-1": "worker-1-token-0123456789",
          "worker-2": "worker-2-token-0123456789", "operator": "operator-token-0123456789",
          "subscriber": "subscriber-token-0123456789",
          "dataplane": "dataplane-token-0123456789"}
UNKNOWN_TOKEN = "not-a-known-token-0123456789"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


def write_identities(directory: pathlib.Path, extra: list[dict] | None = None) -> pathlib.Path:
    """One identity per role; worker-N may use only pool worker-N. The gateway's token is
    given as its digest, the way a file that holds no usable secret does."""
    import hashlib
    entries = [
        {"name": "gateway", "role": "gateway",
         "token_sha256": hashlib.sha256(TOKENS["gateway"].encode()).hexdigest()},
        {"name": "worker-1", "role": "worker", "token": TOKENS["worker-1"], "pools": ["worker-1"]},
        {"name": "worker-2", "role": "worker", "token": TOKENS["worker-2"], "pools": ["worker-2"]},
        {"name": "ops", "role": "operator", "token": TOKENS["operator"]},
        {"name": "dashboards", "role": "subscriber", "token": TOKENS["subscriber"]},
        {"name": "envoy", "role": "dataplane", "token": TOKENS["dataplane"]},
        *(extra or []),
    ]
    path = directory / "service-identities.json"
    path.write_text(json.dumps({"identities": entries}))
    return path


@dataclass
class SecureCache:
    """A cache service with auth on, and channels to it."""
    server: object
    address: str

    @contextlib.contextmanager
    def stub(self, token: str | None = None,
             credentials: grpc.ChannelCredentials | None = None,
             options: list | None = None) -> Iterator[pb_grpc.CacheServiceStub]:
        channel = (grpc.secure_channel(self.address, credentials, options or [])
                   if credentials is not None else grpc.insecure_channel(self.address))
        with channel:
            yield pb_grpc.CacheServiceStub(with_service_token(channel, token))

    def refusals(self, rpc: str, reason: str) -> float:
        return self.server.metrics.registry.get_sample_value(
            "prefixcache_service_auth_refusals_total", {"rpc": rpc, "reason": reason}) or 0.0

    def victim_stats(self) -> pb.PoolStats:
        (pool,) = self.server.core.get_stats(pb.GetStatsRequest(pool_id=VICTIM_POOL)).pools
        return pool

    def victim_info(self) -> pb.PoolInfo:
        return next(p for p in self.server.core.list_pools(pb.ListPoolsRequest()).pools
                    if p.pool_id == VICTIM_POOL)


def register(stub, pool_id: str = VICTIM_POOL, epoch: int = 1, **fields) -> pb.RegisterPoolResponse:
    fields.setdefault("device_pages", DEVICE_PAGES)
    return stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool_id, epoch=epoch, page_size=PAGE,
                                                    model_id=MODEL, **fields), timeout=10)


def namespace(salt: str = VICTIM_SALT) -> common_pb2.Namespace:
    return common_pb2.Namespace(model_id=MODEL, salt=salt)


def cache_prompt(stub, tokens: list[int], salt: str = VICTIM_SALT, pool_id: str = VICTIM_POOL,
                 epoch: int = 1) -> None:
    """What a worker does for a request: match, allocate, publish, release."""
    def step(**ops):
        return stub.Step(pb.StepRequest(pool_id=pool_id, epoch=epoch, **ops), timeout=10)
    lease = step(matches=[pb.MatchOp(request_id="r", namespace=namespace(salt),
                                     token_ids=tokens)]).matches[0].lease_id
    pages = (len(tokens) - 1) // PAGE
    step(allocations=[pb.AllocateOp(lease_id=lease, num_pages=pages)])
    step(publishes=[pb.PublishOp(lease_id=lease, computed_pages=pages)],
         releases=[pb.ReleaseOp(lease_id=lease)])


# test id -> status codes of the probes it saw refused (tests/security/conftest.py prints the
# table: attack tests, probes tried, probes refused by code).
PROBES: dict[str, list[str]] = {}
CURRENT_TEST = [""]


def refused(call, code: grpc.StatusCode) -> str:
    """Runs `call` (one probe), which must fail with `code`; returns the message."""
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "SerializeToString"):
            list(result)  # a stream: its status comes with its first read
    assert err.value.code() == code, f"{err.value.code()}: {err.value.details()}"
    PROBES.setdefault(CURRENT_TEST[0], []).append(code.name)
    return err.value.details()


@contextlib.contextmanager
def secure_cache(tmp_path: pathlib.Path, **config) -> Iterator[SecureCache]:
    """A cache service with auth on (the identities of `write_identities`), and the victim:
    worker-1's pool, registered by worker-1 over gRPC, holding tenant alice's 368-token prompt."""
    config.setdefault("auth", ServiceIdentities.from_file(write_identities(tmp_path)))
    config.setdefault("limits", CacheLimits(max_pool_pages=1 << 20, max_lease_ttl_s=300,
                                            max_subscriptions_per_identity=4))
    with running_server(**config) as server:
        cache = SecureCache(server, f"127.0.0.1:{server.port}")
        if "tls" not in config:
            with cache.stub(TOKENS["worker-1"]) as worker:
                register(worker)
                cache_prompt(worker, VICTIM_PROMPT)
        yield cache
