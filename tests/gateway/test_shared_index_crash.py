"""Crash takeover between real gateway processes (`python -m gateway --index-backend redis`):
two replicas share one real redis-server, one real cache service and two fake workers. The
replica that holds the workers' leases is SIGKILLed (it releases nothing); the other takes over
each worker's indexing within the lease time, resumes the event stream from the seq the dead one
recorded (no snapshot: the worker's slot in the index stays the one it had), writes the events
published meanwhile, and routes by them."""
from __future__ import annotations

import json
import signal
import time

import grpc

from gateway.core.shared_index import SharedIndexConfig, SharedIndexStore
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import gateway_pb2 as gpb
from stack.launcher import free_port
from tests.cache_service.grpc_harness import running_server, stub_for
from tests.gateway.gateway_harness import (TOKENS, Caller, FakeWorker, cache_prompt,
                                           register_pool, wait_until)
from tests.gateway.live_stack import _spawn
from tests.gateway.server_helpers import preview, prompt

LEASE_S = 5.0  # SharedIndexConfig.lease_ms, what `python -m gateway` runs with
RETRY_S = 0.5  # Indexer.retry_s


def head_seqs(stub) -> dict[str, int]:
    return {p.pool_id: p.head_seq for p in stub.ListPools(cpb.ListPoolsRequest(), timeout=5).pools}


def routable(caller: Caller) -> bool:
    try:
        return len(caller.gateway.ListWorkers(gpb.ListWorkersRequest(), metadata=Caller.meta(),
                                              timeout=2).workers) == 2
    except grpc.RpcError:
        return False


def test_a_sigkilled_indexing_replica_is_taken_over_from_the_recorded_seq(redis_server, tmp_path):
    store = SharedIndexStore(SharedIndexConfig(redis_server.url, "crash"))
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tokens": {
        t: {"tenant": v.name, "salt": v.salt} for t, v in TOKENS.items()}}))
    workers = {name: FakeWorker(name) for name in ("w1", "w2")}
    procs = []
    with running_server() as cache, stub_for(cache) as stub:
        for name in workers:
            register_pool(cache.core, name)
        spec = ",".join(f"{w.address}@127.0.0.1:{cache.port}" for w in workers.values())

        def gateway(name: str) -> tuple[object, Caller]:
            proc, address = _spawn(
                ["gateway", "--host", "127.0.0.1", "--port", "0", "--workers", spec,
                 "--tenants-file", str(tenants), "--metrics-port", str(free_port()),
                 "--probe-interval-s", "0.5", "--heartbeat-interval-s", "0.2", "--grace-s", "0",
                 "--index-backend", "redis", "--index-redis-url", redis_server.url,
                 "--index-namespace", "crash"], tmp_path / f"{name}.log")
            procs.append(proc)
            caller = Caller(address)
            wait_until(lambda: routable(caller), timeout_s=60, what=f"{name} routes")
            return proc, caller

        def holders() -> set[str | None]:
            return {store.holder(w) for w in workers}

        try:
            proc_a, _ = gateway("a")
            # The lease owner is host-pid-tag (gateway/core/indexer_roles.py).
            wait_until(lambda: all(h and f"-{proc_a.pid}-" in h for h in holders()),
                       what="a holds both leases")
            proc_b, caller_b = gateway("b")
            before = prompt(1)
            cache_prompt(cache.core, "w2", before, salt="salt-a")
            wait_until(lambda: preview(caller_b, before).worker == "w2", what="b routes by a's writes")
            wait_until(lambda: all(store.row(w).last_seq == s for w, s in head_seqs(stub).items()),
                       what="a wrote every event")
            rows = {w: store.row(w) for w in workers}

            proc_a.send_signal(signal.SIGKILL)
            proc_a.wait()
            killed = time.monotonic()
            meanwhile = prompt(2)  # published while the dead replica still holds the leases
            cache_prompt(cache.core, "w1", meanwhile, salt="salt-a")
            wait_until(lambda: all(h and f"-{proc_b.pid}-" in h for h in holders()),
                       timeout_s=LEASE_S + 10, what="b takes both leases")
            took = time.monotonic() - killed
            assert took < LEASE_S + RETRY_S + 1.0, took
            wait_until(lambda: all(store.row(w).last_seq == s for w, s in head_seqs(stub).items()),
                       what="b wrote the events published meanwhile")
            after = {w: store.row(w) for w in workers}
            for w in workers:  # resumed, not rebuilt: a snapshot would have taken a new slot
                assert (after[w].slot, after[w].epoch) == (rows[w].slot, rows[w].epoch), w
            assert after["w1"].last_seq > rows["w1"].last_seq
            assert preview(caller_b, meanwhile).worker == "w1"
            assert preview(caller_b, before).worker == "w2"
            assert caller_b.generate(meanwhile)[-1].stats.worker == "w1"
            log_b = (tmp_path / "b.log").read_text()
            assert "event=indexer_lease_taken" in log_b and "event=indexer_resubscribe" not in log_b
            caller_b.close()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for w in workers.values():
                w.stop()
