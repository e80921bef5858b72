"""Workers from an InferencePool through the Kubernetes API (gateway/core/inferencepool.py),
against a stand-in API server that answers the three calls the gateway's Role allows: get the
pool, list its pods, watch them (the Kubernetes wire shapes: a List with a resourceVersion,
then one JSON watch event per line)."""
from __future__ import annotations

import json
import queue
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.core.discovery import WorkerAddress
from gateway.core.inferencepool import POOL_PATH, PODS_PATH, InferencePoolWorkers, KubeApi
from tests.gateway.gateway_harness import wait_until

NS, POOL = "prefixcache", "prefixcache-workers-grpc"


def pod(name: str, ip: str, ready: bool = True, deleting: bool = False, version: str = "1"):
    meta = {"name": name, "resourceVersion": version}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-26T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


class FakeApi:
    """The pool, its pods and a queue of watch events; every request's path, query and token."""

    def __init__(self, pods: list[dict]):
        self.pods, self.events, self.seen = pods, queue.Queue(), []
        self.spec = {"selector": {"matchLabels": {"app.kubernetes.io/name": "compute"}},
                     "targetPorts": [{"number": 50052}]}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                api.seen.append((url.path, query, self.headers.get("Authorization")))
                if url.path == POOL_PATH.format(ns=NS, name=POOL):
                    return self._json({"spec": api.spec})
                if url.path != PODS_PATH.format(ns=NS):
                    return self._json({"message": "not found"}, 404)
                if query.get("watch") != "1":
                    return self._json({"metadata": {"resourceVersion": "10"},
                                       "items": api.pods})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                while True:
                    event = api.events.get()
                    if event is None:
                        return  # the watch call ends; the client resumes
                    self.wfile.write(json.dumps(event).encode() + b"\n")
                    self.wfile.flush()

            def _json(self, body, status=200):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self):
        for _ in range(4):
            self.events.put(None)
        self.server.shutdown()


@pytest.fixture
def api(tmp_path):
    fake = FakeApi([pod("w1", "10.0.0.1"), pod("w2", "10.0.0.2", ready=False),
                    pod("w3", "10.0.0.3", deleting=True)])
    token = tmp_path / "token"
    token.write_text("sa-token-1\n")
    try:
        yield fake, KubeApi(fake.url, token_file=token), token
    finally:
        fake.close()


def addresses(*ips: str) -> list[WorkerAddress]:
    return [WorkerAddress(f"{ip}:50052", f"{ip}:50051") for ip in ips]


def test_the_pools_ready_pods_are_the_workers_and_the_watch_keeps_them(api):
    fake, kube, token = api
    workers = InferencePoolWorkers(f"{NS}/{POOL}", 50051, kube)
    try:
        wait_until(lambda: workers() == addresses("10.0.0.1"), what="the first list")
        path, query, auth = fake.seen[1]
        assert query == {"labelSelector": "app.kubernetes.io/name=compute"}
        assert auth == "Bearer sa-token-1"
        fake.events.put({"type": "MODIFIED", "object": pod("w2", "10.0.0.2", version="11")})
        wait_until(lambda: workers() == addresses("10.0.0.1", "10.0.0.2"), what="w2 ready")
        watch = next(q for p, q, _ in fake.seen if q.get("watch") == "1")
        assert watch["resourceVersion"] == "10"  # the list's: no event in between is lost
        fake.events.put({"type": "DELETED", "object": pod("w1", "10.0.0.1", version="12")})
        fake.events.put({"type": "MODIFIED", "object": pod("w2", "10.0.0.2", deleting=True)})
        wait_until(lambda: workers() == [], what="both gone")
        # The watch ends (timeoutSeconds): it resumes from the last version, re-reading the
        # token (projected tokens rotate).
        token.write_text("sa-token-2")
        fake.events.put({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}})
        fake.events.put(None)
        fake.events.put({"type": "ADDED", "object": pod("w4", "fd00::4", version="21")})
        wait_until(lambda: workers() == [WorkerAddress("[fd00::4]:50052", "[fd00::4]:50051")])
        resumed = [(q, a) for p, q, a in fake.seen if q.get("watch") == "1"][-1]
        assert resumed == ({**resumed[0], "resourceVersion": "20"}, "Bearer sa-token-2")
    finally:
        workers.close()


def test_an_expired_watch_lists_again_and_an_unreachable_api_keeps_the_last_set(api):
    fake, kube, _ = api
    workers = InferencePoolWorkers(f"{NS}/{POOL}", 50051, kube)
    try:
        wait_until(lambda: workers() == addresses("10.0.0.1"))
        lists = sum(1 for p, q, _ in fake.seen if p.endswith("/pods") and "watch" not in q)
        fake.pods = [pod("w5", "10.0.0.5")]
        fake.events.put({"type": "ERROR", "object": {"code": 410, "message": "too old"}})
        wait_until(lambda: workers() == addresses("10.0.0.5"), timeout_s=15,
                   what="a fresh list after 410 Gone")
        assert sum(1 for p, q, _ in fake.seen if p.endswith("/pods") and "watch" not in q) > lists
        fake.server.shutdown()  # the API server goes away: the workers stay
        fake.events.put(None)
        assert workers() == addresses("10.0.0.5")
    finally:
        workers.close()


def test_the_flag(monkeypatch, capsys):
    from gateway.__main__ import parse_args
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--workers-inferencepool", "ns/pool", "--allow-anonymous"])
    assert "not inside a Kubernetes pod" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--workers-inferencepool", "ns/pool", "--workers", "a:1",
                    "--allow-anonymous"])
    assert "exactly one of" in capsys.readouterr().err
    with pytest.raises(ValueError, match="NAMESPACE/NAME"):
        InferencePoolWorkers("just-a-name", 50051, KubeApi("http://127.0.0.1:1"))
