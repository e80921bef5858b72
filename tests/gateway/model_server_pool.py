"""Workers as InferencePool model servers behind a real Envoy, for the tests: two fake workers,
a model server beside each (`--model-server`: the gateway's OpenAI HTTP API over that worker,
gateway/core/dataplane_tenants.py, with the other workers as resume targets,
gateway/core/resume_peers.py), the gateway's Endpoint Picker routing OpenAI HTTP to them by
prefix (gateway/epp/openai_body.py), and Envoy in front, called with the official `openai`
client."""
from __future__ import annotations

import contextlib
import socket
import threading

import openai

from gateway.core.dataplane_tenants import DataplaneTenants
from gateway.core.discovery import WorkerAddress
from gateway.core.resume_peers import ModelServerWorkers
from prefixcache_client.tokenizer import from_directory
from service_shell import REQUEST_SCOPE_METADATA_KEY, SALT_METADATA_KEY, request_scope
from service_shell.service_token import SERVICE_TOKEN_METADATA_KEY
from tests.cache_service.grpc_harness import running_server
from tests.gateway.conftest import BPE_TOKENIZER
from tests.gateway.envoy_proxy import running_envoy
from tests.gateway.gateway_harness import (DATAPLANE_TOKEN, EPP_CALLERS, Caller, FakeWorker,
                                           register_pool, running_gateway, wait_until)
from tests.gateway.server_helpers import list_workers

SCOPE_A = request_scope("tenant-a")


def dataplane_headers(token: str = DATAPLANE_TOKEN, salt: str | None = "salt-a",
                      scope: str | None = SCOPE_A) -> list[tuple[str, str]]:
    out = [(SERVICE_TOKEN_METADATA_KEY, token)] if token else []
    out += [(SALT_METADATA_KEY, salt)] if salt is not None else []
    return out + ([(REQUEST_SCOPE_METADATA_KEY, scope)] if scope else [])




class Relay:
    """A TCP relay standing for a pod's network: `cut()` resets every connection through it and
    refuses new ones, as when the pod (model server and engine together) is gone."""

    def __init__(self, upstream: int):
        self._upstream, self._sockets, self._lock = upstream, [], threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(("127.0.0.1", self._upstream))
            except OSError:
                return
            with self._lock:
                self._sockets += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def cut(self) -> None:
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):  # a pump already closed it
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            sock.close()


def serve_through_envoy(stack: contextlib.ExitStack, addresses: dict[str, WorkerAddress]):
    """A model server beside each worker (knowing the others as resume targets, reached
    through a `Relay`), a gateway whose Endpoint Picker routes to the model servers, and Envoy
    in front: (gateway, its caller, model servers by worker name, Envoy, relays by name)."""
    servers: dict[str, str] = {}
    relays: dict[str, Relay] = {}
    model_servers = {}
    pool = list(addresses.values())
    for name, address in addresses.items():
        ms = stack.enter_context(running_gateway(
            ModelServerWorkers(address, lambda: pool), tenants=DataplaneTenants(EPP_CALLERS),
            http_port=0, home_worker=address.compute))
        model_servers[name] = ms
        relays[name] = relay = Relay(ms.http_port)
        stack.callback(relay.cut)
        servers[address.compute] = f"127.0.0.1:{relay.port}"
    gw = stack.enter_context(running_gateway(lambda: pool, epp_port=0,
                                             epp_model_servers=lambda a: servers[a]))
    caller = Caller(gw.address)
    stack.callback(caller.close)
    wait_until(lambda: len(list_workers(caller)) == len(pool) and gw.router.ready()
               and all(m.router.ready() and len(m.router.names()) == len(pool)
                       for m in model_servers.values()), timeout_s=30)
    envoy = stack.enter_context(running_envoy(gw.epp.port, service_token=DATAPLANE_TOKEN))
    return gw, caller, model_servers, envoy, relays


@contextlib.contextmanager
def model_server_pool():
    """A cache service, two fake workers with a chat tokenizer, and `serve_through_envoy`."""
    with running_server() as cache, contextlib.ExitStack() as stack:
        workers = {name: FakeWorker(name) for name in ("w1", "w2")}
        stopped: set[str] = set()
        for w in workers.values():
            stack.callback(lambda w=w: w.name in stopped or w.stop())
            w.tokenizer = from_directory(BPE_TOKENIZER)
            register_pool(cache.core, w.name)
        cache_addr = f"127.0.0.1:{cache.port}"
        gw, caller, model_servers, envoy, relays = serve_through_envoy(
            stack, {w.name: WorkerAddress(w.address, cache_addr) for w in workers.values()})
        yield gw, cache, workers, caller, model_servers, envoy, stopped, relays



def client(envoy: str, key: str = "tok-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{envoy}/v1", api_key=key, max_retries=0,
                         timeout=20)

