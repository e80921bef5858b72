"""The gateway over real gRPC on loopback, with torch-free fake workers and a real in-process
cache service whose pools are filled through its core: routing by prefix, spreading, tenant and
adapter isolation, RoutePreview, auth, tokenization, deadline/cancel/Abort, retries, resyncs
(gap, new epoch, gateway restart), workers joining and leaving, metrics, health and the CLI."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.discovery import DnsWorkers, WorkerAddress, parse_static
from gateway.tenants import Tenant, TenantDirectory
from gateway.tokenize import ByteTokenizer, JsonTokenizer
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import gateway_pb2 as gpb
from service_shell import SALT_METADATA_KEY, new_server
from tests.cache_service.grpc_harness import REPO, running_server
from tests.gateway.gateway_harness import (MODEL, Caller, FakeWorker, cache_prompt,
                                           register_pool, request, running_gateway, wait_until)
from tests.gateway.helpers import batch, cleared, heartbeat, pages, stored

SERVING = health_pb2.HealthCheckResponse.SERVING


def prompt(start: int, n: int = 64) -> list[int]:
    """n tokens; distinct `start`s share no page."""
    return [(start * 31 + 7 * i) % 256 for i in range(n)]


@pytest.fixture(scope="module")
def fleet():
    """A cache service with pools w1 and w2, their fake workers, and a gateway over both."""
    with running_server() as cache:
        workers = {name: FakeWorker(name) for name in ("w1", "w2")}
        for name in workers:
            register_pool(cache.core, name)
        cache_addr = f"127.0.0.1:{cache.port}"
        addresses = [WorkerAddress(w.address, cache_addr) for w in workers.values()]
        try:
            with running_gateway(lambda: addresses, metrics_port=0) as gw:
                caller = Caller(gw.address)
                wait_until(lambda: len(list_workers(caller)) == 2 and gw.router.ready())
                yield gw, cache, workers, caller
                caller.close()
        finally:
            for w in workers.values():
                w.stop()


def list_workers(caller: Caller, token: str = "tok-a") -> dict[str, gpb.WorkerInfo]:
    resp = caller.gateway.ListWorkers(gpb.ListWorkersRequest(), metadata=caller.meta(token))
    return {w.worker: w for w in resp.workers}


def preview(caller: Caller, tokens: list[int], token: str = "tok-a",
            adapter: str = "") -> gpb.RoutePreviewResponse:
    return caller.gateway.RoutePreview(gpb.RoutePreviewRequest(request=request(tokens, adapter)),
                                       metadata=caller.meta(token))


def cached_on(fleet, pool: str, tokens: list[int], salt: str = "salt-a", adapter: str = ""):
    """Caches `tokens` on `pool` and waits until the gateway's index shows it."""
    gw, cache, _, caller = fleet
    before = list_workers(caller)[pool].device_pages
    cache_prompt(cache.core, pool, tokens, salt=salt, adapter=adapter)
    wait_until(lambda: list_workers(caller)[pool].device_pages > before, what="index update")


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def sample(gw, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


# ---- torch-free, and tokenizers that agree with the workers' --------------------------------

def test_gateway_never_imports_torch():
    code = ("import sys, gateway.server, gateway.__main__, gateway.replay; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_tokenizers_produce_the_workers_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from compute_service.model.tokenizer import ByteTokenizer as WorkerBytes
    from compute_service.model.tokenizer import HFTokenizer

    text = "héllo wörld, ünïcode ✓ and more"
    assert ([ByteTokenizer.bos_token_id] + ByteTokenizer().encode(text)
            == WorkerBytes().encode(text, add_bos=WorkerBytes().bos_token_id is not None))
    assert ByteTokenizer.vocab_size == WorkerBytes().vocab_size
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *text.replace(",", " ,").split()])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    ours, theirs = JsonTokenizer(tmp_path), HFTokenizer(tmp_path, 1, (2,))
    assert ours.bos_token_id == 1 and ours.vocab_size == theirs.vocab_size
    assert [1] + ours.encode(text + " unknown") == theirs.encode(text + " unknown", add_bos=True)


# ---- routing ---------------------------------------------------------------------------------

def test_routes_to_the_holder_with_the_tenant_salt_never_the_clients(fleet):
    gw, _, workers, caller = fleet
    tokens = prompt(1)
    cached_on(fleet, "w2", tokens)
    out = caller.generate(tokens, extra=((SALT_METADATA_KEY, "forged"),))
    assert out[-1].stats.worker == "w2"
    seen = workers["w2"].seen[-1]
    assert list(seen.request.token_ids.ids) == tokens
    assert seen.salts == ["salt-a"]  # the tenant's, the client's own dropped
    assert sample(gw, "prefixcache_gateway_requests_total", worker="w2", outcome="ok") >= 1
    assert sample(gw, "prefixcache_gateway_matched_tokens_total", medium="device") >= 60


def test_equal_scores_are_spread(fleet):
    _, _, _, caller = fleet
    chosen = {caller.generate(prompt(100 + i))[-1].stats.worker for i in range(6)}
    assert chosen == {"w1", "w2"}


def test_namespace_isolation_is_paired(fleet):
    _, _, workers, caller = fleet
    tokens = prompt(2)
    cached_on(fleet, "w1", tokens, salt="salt-a")
    same = preview(caller, tokens, "tok-a")
    assert same.worker == "w1"
    assert {c.worker: c.device_tokens for c in same.candidates}["w1"] == 60
    for other in (preview(caller, tokens, "tok-b"), preview(caller, tokens, "tok-a", "lora-x")):
        assert all(c.device_tokens + c.host_tokens + c.remote_tokens == 0
                   for c in other.candidates)
    assert caller.generate(tokens, "tok-a")[-1].stats.worker == "w1"
    caller.generate(tokens, "tok-b")
    assert any(s.salts == ["salt-b"] for w in workers.values() for s in w.seen)


def test_route_preview_explains(fleet):
    _, _, workers, caller = fleet
    tokens, busy = prompt(3), prompt(4)
    cached_on(fleet, "w2", tokens[:33])
    cached_on(fleet, "w1", busy)
    workers["w1"].delay_s = 0.3  # keeps one request in flight on w1 while the preview is taken
    try:
        running = caller.stream(busy, request_id="preview-load")
        next(running)
        resp = preview(caller, tokens)
        running.cancel()
    finally:
        workers["w1"].delay_s = 0.0
    assert resp.policy == "affinity" and resp.prompt_tokens == 64 and resp.worker == "w2"
    assert resp.reason.startswith("holds 32 of 64 prompt tokens (device 32, host 0, remote 0)")
    rows = {c.worker: c for c in resp.candidates}
    assert rows.keys() == {"w1", "w2"} and all(c.eligible for c in rows.values())
    assert (rows["w2"].device_tokens, rows["w1"].device_tokens) == (32, 0)
    assert rows["w2"].score < rows["w1"].score
    assert all(0 <= c.staleness_s < 5 and c.address for c in rows.values())
    assert (rows["w1"].in_flight, rows["w2"].in_flight) == (1, 0)
    # A preview changes nothing: the policy does not remember the prompt as routed.
    gw = fleet[0]
    sizes = {w: gw.router.policy.recent.size(w) for w in workers}
    for _ in range(3):
        assert preview(caller, prompt(18)).worker
    assert {w: gw.router.policy.recent.size(w) for w in workers} == sizes


# ---- requests: auth, prompts, deadline, cancel, abort ---------------------------------------

def test_auth_names_the_header(fleet):
    _, _, _, caller = fleet
    for token in (None, "nope"):
        err = rpc_error(lambda: caller.generate(prompt(5), token))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.details().startswith("authorization:")
    err = rpc_error(lambda: list_workers(caller, "nope"))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_text_prompt_is_tokenized_as_the_worker_would(fleet):
    _, _, workers, caller = fleet
    out = caller.generate("héllo")
    seen = workers[out[-1].stats.worker].seen[-1]
    assert list(seen.request.token_ids.ids) == [257, *"héllo".encode()]
    for bad, field in (([], "prompt"), ([1, -2], "prompt.token_ids")):
        err = rpc_error(lambda: caller.generate(bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith(field + ":")


def test_deadline_and_cancellation_reach_the_worker(fleet):
    _, _, workers, caller = fleet
    tokens = prompt(6)
    cached_on(fleet, "w1", tokens)
    caller.generate(tokens, timeout=4.0)
    assert 3.0 < workers["w1"].seen[-1].time_remaining < 4.5  # (gRPC rounds deadlines up)
    workers["w1"].delay_s, workers["w1"].tokens = 0.2, 50
    try:
        stream = caller.stream(tokens, request_id="cancel-me")
        next(stream)
        stream.cancel()
        seen = workers["w1"].seen[-1]
        assert seen.request.request_id == "cancel-me"
        assert seen.cancelled.wait(5)
    finally:
        workers["w1"].delay_s, workers["w1"].tokens = 0.0, 3


def test_abort_by_request_id_within_the_tenant(fleet):
    _, _, workers, caller = fleet
    tokens = prompt(7)
    cached_on(fleet, "w2", tokens)
    workers["w2"].delay_s, workers["w2"].tokens = 0.1, 20
    try:
        stream = caller.stream(tokens, request_id="job-1")
        next(stream)
        err = rpc_error(lambda: caller.generate(prompt(8), request_id="job-1"))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        abort = caller.compute.Abort
        assert not abort(pb.AbortRequest(request_id="job-1"), metadata=caller.meta("tok-b")).aborted
        assert abort(pb.AbortRequest(request_id="job-1"), metadata=caller.meta("tok-a")).aborted
        assert workers["w2"].aborted == ["job-1"]
        stream.cancel()
    finally:
        workers["w2"].delay_s, workers["w2"].tokens = 0.0, 3


# ---- failures: retry before the first token, a clear error after it ---------------------------

def test_worker_failing_before_the_first_token_is_retried_on_the_next(fleet):
    gw, _, workers, caller = fleet
    tokens = prompt(9)
    cached_on(fleet, "w1", tokens)
    workers["w1"].fail = "before"
    try:
        out = caller.generate(tokens)
    finally:
        workers["w1"].fail = ""
    assert out[-1].stats.worker == "w2"
    assert workers["w1"].seen[-1].request.request_id == workers["w2"].seen[-1].request.request_id
    assert sample(gw, "prefixcache_gateway_retries_total", worker="w1") >= 1
    # Its readiness probe (still SERVING) brings it back.
    wait_until(lambda: gw.router.get("w1").up, what="w1 up again")
    # One retry only; when it fails too, the client is told which workers failed.
    for w in workers.values():
        w.fail = "before"
    try:
        err = rpc_error(lambda: caller.generate(tokens))
    finally:
        for w in workers.values():
            w.fail = ""
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed before the first token" in err.details()
    assert "w1" in err.details() and "w2" in err.details()
    wait_until(lambda: gw.router.get("w1").up and gw.router.get("w2").up, what="both up")


def test_worker_failing_mid_stream_is_a_clear_error(fleet):
    gw, _, workers, caller = fleet
    tokens = prompt(10)
    cached_on(fleet, "w2", tokens)
    workers["w2"].fail = "mid"
    try:
        stream = caller.stream(tokens)
        assert next(stream).token_ids == [65]
        err = rpc_error(lambda: list(stream))
    finally:
        workers["w2"].fail = ""
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker w2" in err.details() and "mid-stream" in err.details()
    assert sample(gw, "prefixcache_gateway_requests_total", worker="w2",
                  outcome="failed_mid_stream") == 1
    wait_until(lambda: gw.router.get("w2").up, what="w2 up again")


# ---- the event streams: resyncs and restarts --------------------------------------------------

class ScriptedCache(cpb_grpc.CacheServiceServicer):
    """Subscribe answers the n-th subscription with scripts[n], then idles until cancelled."""

    def __init__(self, scripts: list[list[cpb.SubscribeResponse]]):
        self.scripts, self.requests = scripts, []
        self.server = new_server(8, "scripted-cache", [])
        cpb_grpc.add_CacheServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Subscribe(self, request, context):
        self.requests.append(request)
        yield from self.scripts[min(len(self.requests), len(self.scripts)) - 1]
        while context.is_active():
            time.sleep(0.02)


def items(*batches) -> list[cpb.SubscribeResponse]:
    return [cpb.SubscribeResponse(batch=b) if b.DESCRIPTOR.name == "EventBatch"
            else cpb.SubscribeResponse(heartbeat=b) for b in batches]


def snapshot(pool: str, seq: int, hashes: list[bytes], epoch: int = 1):
    return batch(pool, seq, cleared(), stored(hashes), epoch=epoch, snapshot=True,
                 snapshot_end=True)


@pytest.mark.parametrize("case", ["gap", "new_epoch"])
def test_resync_resubscribes_where_the_index_says(case):
    pool = "ws"
    if case == "gap":  # seq 0 applied, then seq 3: replay from 0
        first = items(snapshot(pool, 0, pages(0, 4)), batch(pool, 3, stored(pages(9, 10))))
        second = items(*(batch(pool, s, stored(pages(s * 10, s * 10 + 2))) for s in (1, 2, 3)))
        want_request, want_pages, want_epoch, want_seq = (1, 0), {*pages(0, 4), *pages(10, 12),
                                                                  *pages(20, 22), *pages(30, 32)}, 1, 3
    else:  # a live batch of epoch 2 without a snapshot: a fresh snapshot of epoch 2
        first = items(snapshot(pool, 0, pages(0, 4)), batch(pool, 5, stored(pages(9, 10)),
                                                             epoch=2))
        second = items(snapshot(pool, 5, pages(50, 53), epoch=2), heartbeat(pool, 5, epoch=2))
        want_request, want_pages, want_epoch, want_seq = (2, -1), set(pages(50, 53)), 2, 5
    cache, worker = ScriptedCache([first, second]), FakeWorker(pool)
    try:
        with running_gateway(lambda: [WorkerAddress(worker.address, cache.address)]) as gw:
            def resynced() -> bool:  # the second subscription's batches applied, not only sent
                with gw.router.lock:
                    info = gw.router.index.info(pool)
                return (len(cache.requests) == 2 and gw.router.ready() and info is not None
                        and (info.epoch, info.last_seq) == (want_epoch, want_seq))
            wait_until(resynced, what="resync")
            assert (cache.requests[0].epoch, cache.requests[0].after_seq) == (0, -1)
            assert (cache.requests[1].epoch, cache.requests[1].after_seq) == want_request
            with gw.router.lock:
                assert set(gw.router.index.pages(pool, 1)) == want_pages
                assert gw.router.index.info(pool).epoch == want_epoch
            assert sample(gw, "prefixcache_gateway_resyncs_total", worker=pool) == 1
    finally:
        worker.stop()
        cache.server.stop(0)


def test_worker_restart_and_gateway_restart_keep_routing():
    """A worker's new epoch replaces its index entries; a new gateway starts from snapshots
    and routes as the old one did."""
    with running_server() as cache:
        workers = [FakeWorker("w1"), FakeWorker("w2")]
        cache_addr = f"127.0.0.1:{cache.port}"
        for w in workers:
            register_pool(cache.core, w.name)
        tokens, old = prompt(11), prompt(12)
        cache_prompt(cache.core, "w1", old, salt="salt-a")
        addresses = [WorkerAddress(w.address, cache_addr) for w in workers]
        try:
            with running_gateway(lambda: addresses) as gw:
                caller = Caller(gw.address)
                wait_until(lambda: len(list_workers(caller)) == 2, what="both workers")
                wait_until(lambda: preview(caller, old).worker == "w1", what="old prefix")
                register_pool(cache.core, "w1", epoch=2)  # w1 restarted: its cache is empty
                cache_prompt(cache.core, "w1", tokens, salt="salt-a", epoch=2)
                wait_until(lambda: list_workers(caller)["w1"].epoch == 2
                           and list_workers(caller)["w1"].device_pages == 15, what="epoch 2")
                before = preview(caller, tokens)
                assert all(c.device_tokens == 0 for c in preview(caller, old).candidates)
                caller.close()
            with running_gateway(lambda: addresses) as gw2:
                caller = Caller(gw2.address)
                # Ready once any worker is routable: wait for w1's snapshot itself.
                wait_until(lambda: gw2.router.ready() and len(list_workers(caller)) == 2
                           and list_workers(caller)["w1"].epoch == 2
                           and list_workers(caller)["w1"].device_pages == 15, what="snapshots")
                after = preview(caller, tokens)
                assert after.worker == before.worker == "w1"
                assert after.reason == before.reason
                assert after.candidates[0].device_tokens == 60
                caller.close()
        finally:
            for w in workers:
                w.stop()


def test_workers_join_and_leave_at_runtime(caplog):
    with running_server() as cache:
        workers = {n: FakeWorker(n) for n in ("w1", "w2", "w3")}
        other = FakeWorker("odd", model_id="another-model")
        for n in (*workers, "odd"):
            register_pool(cache.core, n, model_id="another-model" if n == "odd" else MODEL)
        cache_addr = f"127.0.0.1:{cache.port}"
        current = [WorkerAddress(workers["w1"].address, cache_addr),
                   WorkerAddress(other.address, cache_addr)]
        try:
            with running_gateway(lambda: list(current), model_id=MODEL) as gw:
                caller = Caller(gw.address)
                wait_until(lambda: set(list_workers(caller)) == {"w1"}, what="w1 only")
                current.append(WorkerAddress(workers["w3"].address, cache_addr))
                wait_until(lambda: set(list_workers(caller)) == {"w1", "w3"}, what="w3 joins")
                # w1 leaves while streaming (a pod draining after its DNS record went): its
                # running call still ends normally.
                workers["w1"].delay_s, workers["w1"].tokens = 0.1, 10
                cached = prompt(17)
                cache_prompt(cache.core, "w1", cached, salt="salt-a")
                wait_until(lambda: preview(caller, cached).worker == "w1", what="w1 holds it")
                draining = caller.stream(cached)
                next(draining)
                del current[0]
                wait_until(lambda: set(list_workers(caller)) == {"w3"}, what="w1 leaves")
                assert list(draining)[-1].stats.worker == "w1"
                with gw.router.lock:
                    assert gw.router.index.workers() == ["w3"]
                assert caller.generate(prompt(13))[-1].stats.worker == "w3"
                assert "odd" not in list_workers(caller)
                wait_until(lambda: "event=worker_refused" in caplog.text)
                assert "another-model" in caplog.text
                caller.close()
        finally:
            for w in (*workers.values(), other):
                w.stop()


# ---- discovery and tenants, without servers ---------------------------------------------------

def test_static_and_dns_discovery():
    assert parse_static("10.0.0.1:50052, 10.0.0.2:50052@cache:7000", 50051) == [
        WorkerAddress("10.0.0.1:50052", "10.0.0.1:50051"),
        WorkerAddress("10.0.0.2:50052", "cache:7000")]
    for bad in ("nohost", "a:1,a:1", "a:1@b"):
        with pytest.raises(ValueError, match="--workers"):
            parse_static(bad, 50051)
    answers: list = [["10.0.0.2", "10.0.0.1"], OSError("SERVFAIL"), ["fd00::1"]]

    def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("compute-headless", 50052)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return sorted(answer)

    dns = DnsWorkers("compute-headless:50052", 50051, resolve)
    first = dns()
    assert first == [WorkerAddress("10.0.0.1:50052", "10.0.0.1:50051"),
                     WorkerAddress("10.0.0.2:50052", "10.0.0.2:50051")]
    assert dns() == first  # a failed lookup keeps the last answer
    assert dns() == [WorkerAddress("[fd00::1]:50052", "[fd00::1]:50051")]


def test_tenants_file(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tokens": {"t1": {"tenant": "a", "salt": "s"}}}))
    tenants = TenantDirectory.from_file(path)
    assert tenants.authenticate([("authorization", "Bearer t1")]) == Tenant("a", "s")
    anonymous = TenantDirectory.from_file(path, allow_anonymous=True)
    assert anonymous.authenticate([]) == Tenant("anonymous", "")
    path.write_text(json.dumps({"tokens": {"t1": {"salt": "s"}}}))
    with pytest.raises(ValueError, match="tokens entry 0"):
        TenantDirectory.from_file(path)


# ---- health, metrics, the command line ----------------------------------------------------------

def test_readiness_follows_the_workers_and_metrics_count(fleet):
    gw, _, _, caller = fleet
    with grpc.insecure_channel(gw.address) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        wait_until(lambda: check(health_pb2.HealthCheckRequest(service="readiness")).status
                   == SERVING, what="ready")  # re-evaluated every 0.25 s
    assert sample(gw, "prefixcache_gateway_workers", state="eligible") == 2
    caller.generate(prompt(14))
    assert sample(gw, "prefixcache_gateway_routing_decision_seconds_count") >= 1
    assert sample(gw, "prefixcache_gateway_prompt_tokens_total") >= 64
    text = __import__("urllib.request").request.urlopen(
        f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5).read().decode()
    assert 'prefixcache_gateway_index_pages{medium="device",worker="w1"}' in text
    with running_gateway(lambda: [], health_port=0) as empty:
        with grpc.insecure_channel(f"127.0.0.1:{empty.health_port}") as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            assert check(health_pb2.HealthCheckRequest(service="liveness")).status == SERVING
            assert check(health_pb2.HealthCheckRequest(service="readiness")).status != SERVING
        err = rpc_error(lambda: Caller(empty.address).generate(prompt(15)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_serves_until_sigterm(fleet, tmp_path):
    _, cache, workers, _ = fleet
    spec = ",".join(f"{w.address}@127.0.0.1:{cache.port}" for w in workers.values())
    bad = subprocess.run([sys.executable, "-m", "gateway", "--workers", spec], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tenants-file or --allow-anonymous" in bad.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", "0",
         "--allow-anonymous", "--heartbeat-interval-s", "0.1", "--grace-s", "2"], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PREFIXCACHE_WORKERS": spec, "PREFIXCACHE_POLICY": "round_robin"})
    # Drained from the start: a gateway blocked on a full stderr pipe could never exit.
    err: list[str] = []
    drain = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    drain.start()
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on "), "".join(err)
        address = line.split()[-1]
        caller = Caller(address)
        wait_until(lambda: len(list_workers(caller, None)) == 2, timeout_s=20)
        out = caller.generate(prompt(16), None)
        assert workers[out[-1].stats.worker].seen[-1].salts == [""]
        caller.close()
        proc.send_signal(signal.SIGTERM)
        # A 2 s grace bounds the drain (default 20 s, plus 5 s of aborts): on a loaded machine the
        # default could outlast this wait. Past it the log says which step was slow.
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            drain.join(timeout=10)
            raise AssertionError("no exit within 30 s of SIGTERM:\n" + "".join(err)) from None
        assert code == 0, "".join(err)
        drain.join(timeout=10)
        log = "".join(err)
        for event in ("event=server_started", "policy=round_robin", "event=drain_started",
                      "event=server_stopped"):
            assert event in log, event
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_discovers_workers_by_dns(fleet, tmp_path):
    _, cache, workers, _ = fleet
    port = workers["w1"].address.rsplit(":", 1)[1]
    log_path = tmp_path / "gateway.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "gateway", "--host", "127.0.0.1",
             "--port", "0", "--allow-anonymous", "--resolve-interval-s", "0.2"],
            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=log_file,
            env={**os.environ, "PREFIXCACHE_WORKERS_DNS": f"127.0.0.1:{port}",
                 "PREFIXCACHE_CACHE_PORT": str(cache.port)})
    try:
        caller = Caller(proc.stdout.readline().split()[-1])
        wait_until(lambda: len(list_workers(caller, None)) == 1, timeout_s=20)
        w1 = list_workers(caller, None)["w1"]
        assert (w1.address, w1.cache_address) == (f"127.0.0.1:{port}", f"127.0.0.1:{cache.port}")
        caller.close()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack
            proc.wait(10)
            raise AssertionError("the gateway did not exit 30 s after SIGTERM; its log:\n"
                                 + log_path.read_text()[-6000:]) from None
        assert code == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
