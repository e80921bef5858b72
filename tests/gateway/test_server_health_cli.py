"""The gateway's readiness and metrics, and `python -m gateway` with static and DNS discovery."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.cache_service.grpc_harness import REPO
from tests.gateway.gateway_harness import Caller, running_gateway, wait_until
from tests.gateway.server_helpers import SERVING, list_workers, prompt, rpc_error, sample


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
                      "event=server_stopped", "event=index_table implementation=c"):
            assert event in log, event
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_discovers_workers_by_dns(fleet, tmp_path):
    """Also: without a C compiler (and no page table built before) the gateway starts with the
    numpy table and says so; with --index-native on it refuses to start."""
    _, cache, workers, _ = fleet
    port = workers["w1"].address.rsplit(":", 1)[1]
    log_path = tmp_path / "gateway.log"
    no_cc = {**os.environ, "CC": str(tmp_path / "no-such-cc"),
             "PREFIXCACHE_KERNEL_CACHE": str(tmp_path / "kernels")}
    refused = subprocess.run([sys.executable, "-m", "gateway", "--allow-anonymous", "--workers",
                              f"127.0.0.1:{port}", "--index-native", "on"], cwd=REPO,
                             capture_output=True, text=True, timeout=60, env=no_cc)
    assert refused.returncode == 1 and "--index-native on" in refused.stderr, refused.stderr
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "gateway", "--host", "127.0.0.1",
             "--port", "0", "--allow-anonymous", "--resolve-interval-s", "0.2"],
            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=log_file,
            env={**no_cc, "PREFIXCACHE_WORKERS_DNS": f"127.0.0.1:{port}",
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
        log = log_path.read_text()
        assert "event=index_table implementation=numpy" in log and "no C compiler" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
