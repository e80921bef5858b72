"""The shared index's indexers (gateway/core/shared_indexer.py) reach the cache services as the
gateway's feeds do (`WorkerSettings.cache_channel`): a cache service with service
authentication on, and one with mTLS as well, streams a worker's pages into the index in a real
redis-server when the indexer has the gateway's settings; without its token (or its TLS) the
cache service refuses the Subscribe and Redis gets nothing. And a gateway started with a service
token and `--index-backend redis` (refused until issue 31) indexes its worker."""
from __future__ import annotations

import logging

import grpc
import pytest

from gateway.__main__ import config_from_args, parse_args
from gateway.core.discovery import WorkerAddress
from gateway.core.shared_index import SharedIndexConfig, SharedIndexStore, SharedIndexView
from gateway.core.shared_indexer import Indexer
from gateway.core.workers import WorkerSettings
from prefixcache_client.hash import chain_hashes, namespace_seed, token_bytes
from service_shell import TlsConfig
from tests.gateway.gateway_harness import FakeWorker, running_gateway, settings
from tests.gateway.test_shared_index import wait_until
from tests.security.harness import (MODEL, PAGE, TOKENS, VICTIM_POOL, VICTIM_PROMPT, VICTIM_SALT,
                                    cache_prompt, register, secure_cache)
from tests.service_shell.certs import make_pki

GATEWAY_TOKEN = TOKENS["gateway"]
VICTIM_PAGES = (len(VICTIM_PROMPT) - 1) // PAGE


@pytest.fixture
def index(redis_server) -> SharedIndexStore:
    return SharedIndexStore(SharedIndexConfig(redis_server.url, "auth", lease_ms=1500))


def indexed_pages(store: SharedIndexStore) -> int:
    """The device pages of the worker's cached prompt the shared index knows."""
    hashes = chain_hashes(namespace_seed(MODEL, "", VICTIM_SALT), token_bytes(VICTIM_PROMPT), PAGE)
    found = SharedIndexView(store).lookup(hashes).get(VICTIM_POOL)
    return 0 if found is None else found.device_pages


def turns_ended(caplog, code: grpc.StatusCode) -> int:
    """The indexer's turns that ended on a refused Subscribe with `code`."""
    return sum("indexer_turn_ended" in r.getMessage() and code.name in r.getMessage()
               for r in caplog.records)


def indexer(store: SharedIndexStore, address: str, settings: WorkerSettings) -> Indexer:
    return Indexer(store, VICTIM_POOL, address, "replica-a", connect=settings.cache_channel,
                   retry_s=0.1).start()


def refused(store, address, settings: WorkerSettings, caplog, code: grpc.StatusCode) -> None:
    """An indexer with `settings` takes the lease but its Subscribe is refused (`code`), turn
    after turn: the index gets nothing."""
    before = turns_ended(caplog, code)
    lacking = indexer(store, address, settings)
    try:
        wait_until(lambda: turns_ended(caplog, code) >= before + 2)
        assert store.row(VICTIM_POOL) is None and indexed_pages(store) == 0
    finally:
        lacking.stop()


def served(store, address, settings: WorkerSettings) -> None:
    """An indexer with `settings` (the gateway's) fills the index with the worker's pages."""
    ix = indexer(store, address, settings)
    try:
        wait_until(lambda: indexed_pages(store) == VICTIM_PAGES)
        assert ix.counters.batches >= 1 and store.holder(VICTIM_POOL) == "replica-a"
    finally:
        ix.stop()


def test_an_indexer_sends_the_gateways_service_token(tmp_path, index, caplog):
    caplog.set_level(logging.WARNING, logger="gateway.shared_indexer")
    with secure_cache(tmp_path) as cache:  # auth on; worker-1's pool holds a cached prompt
        refused(index, cache.address, WorkerSettings(), caplog, grpc.StatusCode.UNAUTHENTICATED)
        assert cache.refusals("Subscribe", "missing_credentials") >= 2
        served(index, cache.address, WorkerSettings(service_token=GATEWAY_TOKEN))


def test_a_refused_indexer_steps_aside_for_a_replica_whose_token_works(tmp_path, redis_server,
                                                                        caplog):
    """Two replicas' indexers for one worker: the one without the token, started first, holds
    the lease and is refused; it releases the lease and waits a lease period, so the replica with
    the gateway's token takes the worker at once and indexes it. (It used to keep the lease until
    it expired, then race for it again: with this 60 s lease the worker stayed unindexed.)"""
    caplog.set_level(logging.WARNING, logger="gateway.shared_indexer")
    index = SharedIndexStore(SharedIndexConfig(redis_server.url, "auth", lease_ms=60_000))
    with secure_cache(tmp_path) as cache:
        lacking = Indexer(index, VICTIM_POOL, cache.address, "replica-a",
                          connect=WorkerSettings().cache_channel, retry_s=0.1).start()
        try:
            wait_until(lambda: turns_ended(caplog, grpc.StatusCode.UNAUTHENTICATED) >= 1)
            good = Indexer(index, VICTIM_POOL, cache.address, "replica-b", retry_s=0.1,
                           connect=WorkerSettings(service_token=GATEWAY_TOKEN).cache_channel).start()
            try:
                wait_until(lambda: indexed_pages(index) == VICTIM_PAGES)
                assert index.holder(VICTIM_POOL) == "replica-b"
            finally:
                good.stop()
        finally:
            lacking.stop()


def test_an_indexer_speaks_mtls_with_the_token(tmp_path, index, caplog):
    caplog.set_level(logging.WARNING, logger="gateway.shared_indexer")
    pki = make_pki(tmp_path)
    client_tls = TlsConfig(cert=pki.client.cert, key=pki.client.key, ca=pki.ca)
    server_tls = TlsConfig(cert=pki.server.cert, key=pki.server.key, ca=pki.ca)
    with secure_cache(tmp_path, tls=server_tls) as cache:
        with cache.stub(TOKENS["worker-1"], client_tls.channel_credentials()) as worker:
            register(worker)
            cache_prompt(worker, VICTIM_PROMPT)
        # The client certificate names no identity: without the token, UNAUTHENTICATED.
        refused(index, cache.address, WorkerSettings(tls=client_tls), caplog,
                grpc.StatusCode.UNAUTHENTICATED)
        # The token on a plaintext channel: no handshake, no stream.
        refused(index, cache.address, WorkerSettings(service_token=GATEWAY_TOKEN), caplog,
                grpc.StatusCode.UNAVAILABLE)
        served(index, cache.address, WorkerSettings(tls=client_tls, service_token=GATEWAY_TOKEN))


def test_a_gateway_with_a_service_token_runs_the_shared_index(tmp_path, redis_server, index):
    token_file = tmp_path / "gateway-token"
    token_file.write_text(GATEWAY_TOKEN + "\n")
    flags = config_from_args(parse_args([
        "--workers", "localhost:50052", "--allow-anonymous", "--index-backend", "redis",
        "--index-redis-url", redis_server.url, "--service-token-file", str(token_file)]))
    assert (flags.index_backend, flags.worker.service_token) == ("redis", GATEWAY_TOKEN)
    worker = FakeWorker(VICTIM_POOL)
    try:
        with secure_cache(tmp_path) as cache, running_gateway(
                lambda: [WorkerAddress(worker.address, cache.address)], index_backend="redis",
                index_redis_url=redis_server.url, index_namespace=index.config.namespace,
                worker=settings(service_token=GATEWAY_TOKEN)) as gw:
            wait_until(lambda: gw.indexers.held() == 1 and indexed_pages(index) == VICTIM_PAGES)
            assert cache.refusals("Subscribe", "missing_credentials") == 0
    finally:
        worker.stop()
