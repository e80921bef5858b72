"""Workers from an InferencePool (--workers-inferencepool [NAMESPACE/]NAME, by default in the
gateway pod's own namespace): the pods its selector
picks, Ready and not terminating, at its target port, kept current by a watch on the Kubernetes
API, so that the Endpoint Picker chooses among exactly the endpoints the pool has (the Gateway
API Inference Extension's own EPP does the same), not among a DNS name's.

The API is reached as a pod reaches it (in-cluster: KUBERNETES_SERVICE_HOST / _PORT, the
service-account token, re-read on every request since projected tokens rotate, and the
cluster CA); the gateway's Role needs `get` on that one InferencePool and `list` / `watch` on
pods (deploy/k8s/components/inference-extension/rbac.yaml). A failed read keeps the last set:
an API-server hiccup must not drop every worker's warm index (a worker that is really gone stops
answering its readiness probes and leaves the routing anyway).
"""
from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from gateway.core.discovery import WorkerAddress
from service_shell import kv

log = logging.getLogger("gateway.discovery")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
POOL_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}"
PODS_PATH = "/api/v1/namespaces/{ns}/pods"
# A watch call ends after this many seconds (the API server's timeoutSeconds); then it resumes.
WATCH_S = 60
RETRY_S = 2.0


class KubeApi:
    """GET requests to the Kubernetes API, JSON answers; `stream` yields a watch's events."""

    def __init__(self, base_url: str | None = None, token_file: Path | None = None,
                 ca_file: Path | None = None) -> None:
        if base_url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            if not host:
                raise ValueError("--workers-inferencepool: not inside a Kubernetes pod "
                                 "(KUBERNETES_SERVICE_HOST is not set)")
            host = f"[{host}]" if ":" in host else host
            base_url = f"https://{host}:{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"
            token_file, ca_file = SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt"
        self.base_url, self.token_file = base_url.rstrip("/"), token_file
        self._ssl = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None

    def _open(self, path: str, query: dict[str, str], timeout_s: float):
        url = f"{self.base_url}{path}?{urllib.parse.urlencode(query)}" if query else \
            f"{self.base_url}{path}"
        req = urllib.request.Request(url, headers={"Accept": "application/json"})
        if self.token_file is not None:
            req.add_header("Authorization", f"Bearer {self.token_file.read_text().strip()}")
        return urllib.request.urlopen(req, timeout=timeout_s, context=self._ssl)

    def get(self, path: str, query: dict[str, str] | None = None) -> dict:
        with self._open(path, query or {}, 10.0) as resp:
            return json.load(resp)

    def stream(self, path: str, query: dict[str, str]) -> Iterator[dict]:
        with self._open(path, {**query, "watch": "1"}, WATCH_S + 10.0) as resp:
            for line in resp:
                if line.strip():
                    yield json.loads(line)


def _ready_ip(pod: dict) -> str | None:
    status = pod.get("status", {})
    if pod.get("metadata", {}).get("deletionTimestamp") or not status.get("podIP"):
        return None
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions", ()))
    return status["podIP"] if ready else None


class InferencePoolWorkers:
    """The pool's Ready pods as WorkerAddresses (compute at the pool's first target port, or
    `port`; cache at `cache_port` of the same pod), as of the watch's last event."""

    def __init__(self, pool: str, cache_port: int, api: KubeApi | None = None,
                 port: int | None = None) -> None:
        ns, sep, name = pool.rpartition("/")
        if not sep:  # the pod's own namespace
            ns = self._api_namespace(api)
        if not ns or not name or "/" in ns:
            raise ValueError(f"--workers-inferencepool: {pool!r} is not [NAMESPACE/]NAME")
        self.namespace, self.name, self.cache_port, self.port = ns, name, cache_port, port
        self._api = api or KubeApi()
        self._ips: dict[str, str] = {}  # pod name -> IP, Ready pods only
        self._target = port
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inferencepool-watch", daemon=True)
        self._thread.start()

    @staticmethod
    def _api_namespace(api: KubeApi | None) -> str:
        """The namespace this pod runs in (its service account's), for a pool named alone."""
        path = (api.token_file.parent if api is not None and api.token_file is not None
                else SERVICE_ACCOUNT) / "namespace"
        try:
            return path.read_text().strip()
        except OSError:
            raise ValueError(f"--workers-inferencepool: no namespace given and {path} is not "
                             "readable; give NAMESPACE/NAME") from None

    def __call__(self) -> list[WorkerAddress]:
        with self._lock:
            ips, port = sorted(set(self._ips.values())), self._target
        if port is None:
            return []
        hosts = [f"[{ip}]" if ":" in ip else ip for ip in ips]
        return [WorkerAddress(f"{h}:{port}", f"{h}:{self.cache_port}") for h in hosts]

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                selector, version = self._list()
                while not self._stop.is_set():
                    version = self._watch(selector, version)
            except (OSError, ValueError, KeyError) as exc:  # URLError is an OSError
                log.warning(kv("inferencepool_watch_failed", pool=f"{self.namespace}/"
                               f"{self.name}", error=exc, kept_workers=len(self._ips)))
            self._stop.wait(RETRY_S)

    def _list(self) -> tuple[str, str]:
        """Reads the pool (its selector and port may change) and lists its pods afresh."""
        spec = self._api.get(POOL_PATH.format(ns=self.namespace, name=self.name))["spec"]
        labels = spec["selector"]["matchLabels"]
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        pods = self._api.get(PODS_PATH.format(ns=self.namespace), {"labelSelector": selector})
        ips = {p["metadata"]["name"]: ip for p in pods.get("items", ())
               if (ip := _ready_ip(p)) is not None}
        with self._lock:
            self._ips = ips
            self._target = self.port or int(spec["targetPorts"][0]["number"])
        return selector, pods["metadata"].get("resourceVersion", "")

    def _watch(self, selector: str, version: str) -> str:
        """Applies one watch call's events; the resourceVersion to resume from. ValueError on
        410 Gone / an ERROR event (the caller lists again)."""
        query = {"labelSelector": selector, "timeoutSeconds": str(WATCH_S),
                 "allowWatchBookmarks": "true"}
        if version:
            query["resourceVersion"] = version
        for event in self._api.stream(PODS_PATH.format(ns=self.namespace), query):
            kind, pod = event.get("type"), event.get("object", {})
            if kind == "ERROR":
                raise ValueError(f"watch error: {pod.get('message', pod)}")
            version = pod.get("metadata", {}).get("resourceVersion", version)
            if kind == "BOOKMARK":
                continue
            name, ip = pod["metadata"]["name"], _ready_ip(pod)
            with self._lock:
                if kind == "DELETED" or ip is None:
                    self._ips.pop(name, None)
                else:
                    self._ips[name] = ip
            if self._stop.is_set():
                break
        return version
