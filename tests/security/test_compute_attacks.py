"""The attacks of issue 16 on a compute worker, against a real worker on loopback with auth on,
whose engine reaches its cache service (auth on too) with its own worker token: the chain the
manifests run. Refused with the right code; the victim (a live adapter, the worker's pool)
intact afterwards."""
from __future__ import annotations

import contextlib

import grpc
import pytest

from compute_service.lora import write_random_adapter
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache_client.cache import CacheClient, CacheClientError
from service_shell.auth import ServiceIdentities
from service_shell.service_token import with_service_token
from tests.compute_service.server_harness import greedy, make_engine, prompt, running
from tests.security.harness import (DENIED, TOKENS, UNAUTHENTICATED, UNKNOWN_TOKEN, refused,
                                    secure_cache, write_identities)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
POOL = "worker-2"  # the identities file lets the worker-2 token use only this pool
ADAPTER = "live-adapter"


@contextlib.contextmanager
def stub(server, token: str | None):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.ComputeServiceStub(with_service_token(channel, token))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(compute server, cache service): a worker with auth on and a live adapter, whose engine
    registered its pool on a cache service with auth on, under its worker token."""
    tmp = tmp_path_factory.mktemp("security-compute")
    write_random_adapter(tmp / ADAPTER, "tiny-transformer", rank=4, seed=1, strength=0.5)
    with secure_cache(tmp) as cache:
        client = CacheClient(cache.address, service_token=TOKENS["worker-2"])
        engine = make_engine(cache=client, pool_id=POOL, max_loaded_adapters=2,
                             max_lora_rank=8, max_loras=2)
        engine.load_adapter(ADAPTER, str(tmp / ADAPTER))
        identities = ServiceIdentities.from_file(write_identities(tmp))
        try:
            with running(engine, auth=identities, metrics_port=0) as (server, _):
                yield server, cache
        finally:
            client.close()


def adapters(server) -> list[str]:
    with stub(server, TOKENS["gateway"]) as s:
        return list(s.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).adapters)


def generate(s, adapter: str = "") -> list[pb.GenerateResponse]:
    return list(s.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(3)),
                                              sampling=greedy(2), adapter=adapter), timeout=60))


def test_attack_unload_adapter_removes_a_live_adapter(worker):
    server, _ = worker
    unload = pb.UnloadAdapterRequest(name=ADAPTER)
    for token in (None, UNKNOWN_TOKEN):
        with stub(server, token) as s:
            refused(lambda: s.UnloadAdapter(unload, timeout=10), UNAUTHENTICATED)
    for role in ("gateway", "subscriber", "worker-2"):
        with stub(server, TOKENS[role]) as s:
            assert "allowed: operator" in refused(lambda: s.UnloadAdapter(unload, timeout=10),
                                                  DENIED)
    assert adapters(server) == [ADAPTER]
    with stub(server, TOKENS["gateway"]) as s:  # still served
        assert generate(s, ADAPTER)[-1].HasField("stats")
    refusals = server.metrics.registry.get_sample_value(
        "prefixcache_service_auth_refusals_total", {"rpc": "UnloadAdapter", "reason": "role"})
    assert refusals == 3


def test_attack_generate_and_manage_adapters_directly_on_a_worker(worker, tmp_path):
    """The worker's port, reached around the gateway: no Generate without the gateway's
    identity, no adapter loaded from the worker's disk without an operator's."""
    server, _ = worker
    for token in (None, UNKNOWN_TOKEN):
        with stub(server, token) as s:
            refused(lambda: generate(s), UNAUTHENTICATED)
            refused(lambda: s.GetModelInfo(pb.GetModelInfoRequest(), timeout=10),
                    UNAUTHENTICATED)
    with stub(server, TOKENS["subscriber"]) as s:
        refused(lambda: generate(s), DENIED)
        assert s.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).worker == POOL  # read-only
    load = pb.LoadAdapterRequest(name="injected", path=str(tmp_path))
    for role in ("gateway", "subscriber"):
        with stub(server, TOKENS[role]) as s:
            refused(lambda: s.LoadAdapter(load, timeout=10), DENIED)
    assert adapters(server) == [ADAPTER]
    with stub(server, TOKENS["gateway"]) as s:
        assert generate(s)[-1].HasField("stats")


def test_the_operator_unloads_and_the_worker_evicts_its_own_pool(worker):
    """What the roles are for: the operator's UnloadAdapter goes through, and the worker's
    EvictNamespace of the adapter's pages (its own pool, its own token) is allowed."""
    server, cache = worker
    with stub(server, TOKENS["operator"]) as s:
        s.UnloadAdapter(pb.UnloadAdapterRequest(name=ADAPTER), timeout=10)
    assert adapters(server) == []
    assert cache.refusals("EvictNamespace", "pool_owner") == 0


def test_a_worker_token_cannot_register_another_workers_pool(worker):
    """A worker started with another worker's token (or pool id) is refused at registration,
    before it serves anything."""
    _, cache = worker
    with CacheClient(cache.address, service_token=TOKENS["worker-1"]) as client:
        with pytest.raises(CacheClientError) as err:
            make_engine(cache=client, pool_id=POOL)
    assert err.value.status == DENIED
    assert "may not use pool 'worker-2'" in err.value.message


def test_attack_the_data_plane_token_used_beyond_a_tenants_generate(worker):
    """Issue 25 finding 1: the data plane's identity (Envoy's token, role dataplane) forwards a
    tenant's Generate to the worker the EPP picked, and nothing else: no model or adapter
    management, no model info, and nothing at all on the cache service (no event stream, no
    other tenant's cached prompt through a Step)."""
    from prefixcache.v1 import cache_service_pb2 as cpb
    from tests.security.harness import VICTIM_POOL, VICTIM_PROMPT, namespace

    server, cache = worker
    loaded = adapters(server)
    with stub(server, TOKENS["dataplane"]) as s:
        assert generate(s)[-1].HasField("stats")  # what it is for
        for call in (lambda: s.GetModelInfo(pb.GetModelInfoRequest(), timeout=10),
                     lambda: s.GetTokenizer(pb.GetTokenizerRequest(), timeout=10),
                     lambda: s.LoadAdapter(pb.LoadAdapterRequest(name="x", path="/tmp"),
                                           timeout=10),
                     lambda: s.UnloadAdapter(pb.UnloadAdapterRequest(name=ADAPTER), timeout=10)):
            refused(call, DENIED)
    with cache.stub(TOKENS["dataplane"]) as c:
        match = cpb.MatchOp(request_id="probe", namespace=namespace(), token_ids=VICTIM_PROMPT)
        for call in (
                lambda: c.Subscribe(cpb.SubscribeRequest(pool_id=VICTIM_POOL), timeout=10),
                lambda: c.Step(cpb.StepRequest(pool_id=VICTIM_POOL, epoch=1, matches=[match]),
                               timeout=10),
                lambda: c.GetStats(cpb.GetStatsRequest(pool_id=VICTIM_POOL), timeout=10),
                lambda: c.ListPools(cpb.ListPoolsRequest(), timeout=10),
                lambda: c.RegisterPool(cpb.RegisterPoolRequest(pool_id="dp-pool", epoch=1),
                                       timeout=10),
                lambda: c.EvictNamespace(cpb.EvictNamespaceRequest(pool_id=VICTIM_POOL),
                                         timeout=10),
                lambda: c.UnregisterPool(cpb.UnregisterPoolRequest(pool_id=VICTIM_POOL),
                                         timeout=10)):
            refused(call, DENIED)
    assert adapters(server) == loaded
    assert cache.victim_info().pool_id == VICTIM_POOL
