"""Scale-in without failed requests: two real workers (`python -m compute_service`) behind a real
gateway (`python -m gateway`), one SIGTERMed under load. The gateway learns of the drain from
its health Watch (its probe interval here is 60 s, so the probes cannot be what takes the worker
out), stops routing to it before the worker stops accepting (`--drain-delay-s`), the worker's
running requests finish, and the queued ones it hands back (UNAVAILABLE before any token) are
retried on the other worker.

Set PREFIXCACHE_DRAIN_REPORT=PATH to write the figures as JSON."""
from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import gateway_pb2 as gpb
from stack.launcher import free_port
from tests.gateway.gateway_harness import TOKENS, Caller, wait_until
from tests.gateway.live_stack import _spawn

CLIENTS = 8  # 4 per worker, 1 running and 3 queued on each (--max-running 1)
MAX_TOKENS = 24
DRAIN_DELAY_S = 0.5


def _log_time(log: str, event: str, **fields: str) -> float:
    """Wall time of the first `event` line (with those fields) of a logfmt log."""
    want = "".join(f" {k}={v}" for k, v in fields.items())
    for line in log.splitlines():
        if f"event={event}" in line and all(f"{k}={v}" in line for k, v in fields.items()):
            ts = re.match(r"ts=(\S+)Z ", line).group(1)
            return datetime.fromisoformat(ts + "+00:00").timestamp()
    raise AssertionError(f"no event={event}{want} in:\n{log[-4000:]}")


@pytest.fixture
def fleet(tmp_path: Path):
    cache = CacheServer(CacheCore(), ServerConfig(host="127.0.0.1", port=0, grace_s=0.0)).start()
    cache_addr = f"127.0.0.1:{cache.port}"
    procs: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name in ("w1", "w2"):
            procs[name] = _spawn(
                ["compute_service", "--model", "tiny-transformer", "--cache-service", cache_addr,
                 "--pool-id", name, "--host", "127.0.0.1", "--port", "0", "--page-size", "4",
                 "--kv-memory-bytes", "8Mi", "--max-context", "1024", "--threads", "1",
                 "--max-running", "1", "--grace-s", "30",
                 "--drain-delay-s", str(DRAIN_DELAY_S)], tmp_path / f"{name}.log")
        tenants = tmp_path / "tenants.json"
        tenants.write_text(json.dumps({"tokens": {
            t: {"tenant": v.name, "salt": v.salt} for t, v in TOKENS.items()}}))
        spec = ",".join(f"{addr}@{cache_addr}" for _, addr in procs.values())
        gateway, address = _spawn(
            ["gateway", "--host", "127.0.0.1", "--port", "0", "--workers", spec,
             "--tenants-file", str(tenants), "--metrics-port", str(free_port()),
             "--probe-interval-s", "60", "--heartbeat-interval-s", "0.2", "--grace-s", "0"],
            tmp_path / "gateway.log")
        procs["gateway"] = (gateway, address)
        caller = Caller(address)

        def ready() -> bool:
            try:
                workers = caller.gateway.ListWorkers(gpb.ListWorkersRequest(),
                                                     metadata=Caller.meta(), timeout=2).workers
            except grpc.RpcError:
                return False
            return len(workers) == 2
        wait_until(ready, timeout_s=120, what="two workers routable")
        yield procs, caller, tmp_path
        caller.close()
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        cache.drain()


def test_sigterm_under_load_drains_without_a_failed_request(fleet):
    procs, caller, logs = fleet
    stop = threading.Event()
    done: list[tuple[float, str]] = []  # (client send time, worker that served it)
    failures: list[str] = []
    counter = itertools.count()

    def client() -> None:
        while not stop.is_set():
            n = next(counter)
            prompt = [(n * 13 + 7 * i) % 256 for i in range(24)]  # no shared pages
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(max_tokens=MAX_TOKENS,
                                                                ignore_eos=True))
            sent = time.time()
            try:
                msgs = list(caller.compute.Generate(req, timeout=60, metadata=Caller.meta()))
            except grpc.RpcError as exc:
                failures.append(f"{exc.code().name}: {exc.details()}")
                continue
            stats = msgs[-1].stats
            if stats.finish_reason != pb.FINISH_REASON_LENGTH or \
                    sum(len(m.token_ids) for m in msgs) != MAX_TOKENS:
                failures.append(f"incomplete: {stats}")
            done.append((sent, stats.worker))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    # Under load on both workers before the drain.
    wait_until(lambda: {w for _, w in done} == {"w1", "w2"} and len(done) >= 20, timeout_s=120,
               what="both workers serving")
    w1 = procs["w1"][0]
    sigterm = time.time()
    w1.send_signal(signal.SIGTERM)
    assert w1.wait(60) == 0
    exited = time.time()
    after = len(done)
    wait_until(lambda: len(done) >= after + 20, timeout_s=120, what="load after the drain")
    stop.set()
    for t in threads:
        t.join(70)

    w1_log = (logs / "w1.log").read_text()
    gateway_log = (logs / "gateway.log").read_text()
    announced = _log_time(w1_log, "drain_started")
    learned = _log_time(gateway_log, "worker_down", worker="w1")
    refused = len(re.findall(r"event=request_rejected code=UNAVAILABLE", w1_log))
    handed = sum(int(n) for n in re.findall(r"event=drain_handing_back requests=(\d+)", w1_log))
    retries = len(re.findall(r"event=generate_retry worker=w1", gateway_log))
    routed_late = [s for s, w in done if w == "w1" and s > learned]
    figures = {
        "requests": len(done) + len(failures), "failed": len(failures),
        "served_by_w1": sum(w == "w1" for _, w in done),
        "served_by_w2": sum(w == "w2" for _, w in done),
        "drain_s": round(exited - sigterm, 3),
        "gateway_learned_after_s": round(learned - announced, 3),
        "drain_delay_s": DRAIN_DELAY_S,
        "requests_sent_to_w1_after_gateway_learned": len(routed_late),
        "refused_by_draining_w1": refused, "handed_back_by_w1": handed,
        "gateway_retries_from_w1": retries,
    }
    print(json.dumps(figures))
    if os.environ.get("PREFIXCACHE_DRAIN_REPORT"):
        Path(os.environ["PREFIXCACHE_DRAIN_REPORT"]).write_text(json.dumps(figures, indent=1))
    assert failures == [], failures[:5]
    # The gateway heard of the drain before the worker stopped accepting, and sent it nothing new
    # after: nothing reached the worker only to be refused.
    assert learned - announced < DRAIN_DELAY_S, figures
    assert routed_late == [] and refused == 0, figures
    # Every hand-back was retried elsewhere (and none of them failed: failures is empty).
    assert retries == handed, figures
    assert "event=server_stopped" in w1_log and "event=drain_abort_timeout" not in w1_log


def test_a_worker_turning_not_serving_leaves_the_routing_at_once():
    """The health Watch, not the probes (60 s apart here), takes a draining worker out."""
    from tests.gateway.gateway_harness import settings
    from tests.gateway.server_helpers import fake_fleet, preview

    with fake_fleet(worker=settings(probe_interval_s=60.0)) as (gw, _, workers, _, caller):
        eligible = lambda: {c.worker for c in preview(caller, [1, 2, 3, 4]).candidates  # noqa
                            if c.eligible}
        wait_until(lambda: eligible() == {"w1", "w2"}, timeout_s=10)
        started = time.monotonic()
        workers["w1"].set_ready(False)
        wait_until(lambda: eligible() == {"w2"}, timeout_s=5, what="w1 out of the routing")
        assert time.monotonic() - started < 1.0
        # Nothing goes to it from here on.
        for i in range(10):
            msgs = caller.generate([i, i + 1, i + 2, i + 3, i + 4])
            assert msgs[-1].stats.worker == "w2"
