"""Helpers for the gateway server tests: torch-free fake compute workers served over real gRPC,
pools of a real in-process cache service filled through its core, a gateway on loopback and
stubs that send the caller's bearer token."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import prometheus_client

from cache_service.core import CacheCore
from gateway.assembly import GatewayConfig, GatewayServer
from gateway.core.discovery import WorkerAddress
from gateway.core.tenants import Tenant, TenantDirectory
from gateway.core.workers import WorkerSettings
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import common_pb2
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache.v1 import gateway_pb2_grpc as gpb_grpc
from prefixcache_client.tokenizer import ByteTokenizer
from service_shell import SALT_METADATA_KEY, ServiceShell, server_options
from service_shell.auth import DATAPLANE, Identity, ServiceIdentities, token_digest
from service_shell.service_token import SERVICE_TOKEN_METADATA_KEY

MODEL = "fake-model"
PAGE = 4
VOCAB = 320
TOKENS = {"tok-a": Tenant("tenant-a", "salt-a"), "tok-b": Tenant("tenant-b", "salt-b")}
# The data plane's (Envoy's) service token: the only identity the gateway's EPP serves.
DATAPLANE_TOKEN = "dataplane-token-0123456789"
EPP_CALLERS = ServiceIdentities({token_digest(DATAPLANE_TOKEN): Identity("envoy", DATAPLANE)})


def wait_until(cond: Callable[[], object], timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"condition not met in time: {what}"
        time.sleep(0.02)


@dataclass
class Seen:
    """What a fake worker received for one Generate call."""
    request: pb.GenerateRequest
    salts: list[str]
    time_remaining: float | None
    service_tokens: list[str] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


class FakeWorker(pb_grpc.ComputeServiceServicer):
    """A compute worker without a model: streams `tokens` messages of one token each
    (`delay_s` apart), then stats naming it. `gate`, an Event, holds every stream after its first
    token until it is set or the call ends (requests in flight for as long as a test needs).
    `fail` makes Generate fail: "before" the first token (with `fail_code`, UNAVAILABLE by
    default, and `fail_message`) or "mid" stream (after one message).
    `adapters`: the LoRA adapters GetModelInfo says are loaded."""

    def __init__(self, name: str, model_id: str = MODEL, page_size: int = PAGE):
        self.name, self.model_id, self.page_size = name, model_id, page_size
        self.tokens, self.delay_s, self.fail = 3, 0.0, ""
        self.gate: threading.Event | None = None
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.fail_message = "fake worker is down"
        self.adapters: list[str] = []
        # The presets' byte-level tokenizer, handed to the gateway as a worker hands its own.
        self.tokenizer = ByteTokenizer()
        self.seen: list[Seen] = []
        self.aborted: list[str] = []
        self._shell = ServiceShell(pb.DESCRIPTOR.services_by_name["ComputeService"].full_name,
                                   host="127.0.0.1", port=0, max_workers=16,
                                   thread_name_prefix=f"fake-{name}", options=server_options(4),
                                   registry=prometheus_client.CollectorRegistry())
        pb_grpc.add_ComputeServiceServicer_to_server(self, self._shell.server)
        self._shell.start()
        self._shell.health.set_ready(True)
        self.address = f"127.0.0.1:{self._shell.port}"

    def stop(self) -> None:
        self._shell.stop(0).wait()
        self._shell.close()

    def set_ready(self, ready: bool) -> None:
        self._shell.health.set_ready(ready)

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model_id=self.model_id, architecture="fake",
                                       vocab_size=VOCAB, max_context_tokens=1024,
                                       page_size=self.page_size, worker=self.name,
                                       adapters=self.adapters,
                                       tokenizer_fingerprint=self.tokenizer.fingerprint)

    def GetTokenizer(self, request, context):
        files = self.tokenizer.files
        return pb.GetTokenizerResponse(fingerprint=self.tokenizer.fingerprint, files=[
            pb.TokenizerFile(name=n, content=files[n]) for n in sorted(files)])

    def Generate(self, request, context):
        meta = context.invocation_metadata()
        seen = Seen(request, [v for k, v in meta if k == SALT_METADATA_KEY],
                    context.time_remaining(),
                    [v for k, v in meta if k == SERVICE_TOKEN_METADATA_KEY])
        context.add_callback(lambda: None if context.is_active() else seen.cancelled.set())
        self.seen.append(seen)
        if self.fail == "before":
            context.abort(self.fail_code, self.fail_message)
        # A resumed request goes on after the tokens it is given, as a real worker does.
        for i in range(len(request.resume_output.ids), self.tokens):
            if i and self.delay_s:
                time.sleep(self.delay_s)
            while i and self.gate is not None and not self.gate.wait(0.05):
                if not context.is_active():
                    break
            if not context.is_active():
                seen.cancelled.set()
                return
            yield pb.GenerateResponse(token_ids=[65 + i], text=chr(65 + i))
            if self.fail == "mid":
                context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker died")
        prompt = len(request.token_ids.ids)
        yield pb.GenerateResponse(stats=pb.GenerateStats(
            request_id=request.request_id, worker=self.name, prompt_tokens=prompt,
            output_tokens=self.tokens, finish_reason=pb.FINISH_REASON_LENGTH))

    def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return pb.AbortResponse(aborted=True)


def register_pool(core: CacheCore, name: str, epoch: int = 1, model_id: str = MODEL) -> None:
    core.register_pool(cpb.RegisterPoolRequest(pool_id=name, epoch=epoch, page_size=PAGE,
                                               model_id=model_id, device_pages=256))


def cache_prompt(core: CacheCore, pool: str, tokens: list[int], *, salt: str = "",
                 adapter: str = "", epoch: int = 1) -> None:
    """Matches, allocates, publishes and releases `tokens` in the pool, in a namespace, so that
    the pool (and its event stream) holds their full pages but the last."""
    ns = common_pb2.Namespace(adapter=adapter, salt=salt)
    step = core.step
    lease = step(cpb.StepRequest(pool_id=pool, epoch=epoch, matches=[cpb.MatchOp(
        request_id="r", namespace=ns, token_ids=tokens)])).matches[0].lease_id
    pages = (len(tokens) - 1) // PAGE
    step(cpb.StepRequest(pool_id=pool, epoch=epoch,
                         allocations=[cpb.AllocateOp(lease_id=lease, num_pages=pages)]))
    step(cpb.StepRequest(pool_id=pool, epoch=epoch,
                         publishes=[cpb.PublishOp(lease_id=lease, computed_pages=pages)],
                         releases=[cpb.ReleaseOp(lease_id=lease)]))


def settings(**overrides) -> WorkerSettings:
    values = dict(probe_interval_s=0.2, heartbeat_interval_s=0.1, rpc_timeout_s=2.0,
                  refused_retry_s=0.5)
    values.update(overrides)
    return WorkerSettings(**values)


@contextlib.contextmanager
def running_gateway(workers: Callable[[], list[WorkerAddress]], *, anonymous: bool = False,
                    **config) -> Iterator[GatewayServer]:
    config.setdefault("worker", settings())
    config.setdefault("resolve_interval_s", 0.2)
    config.setdefault("grace_s", 0.0)
    if config.get("epp_port") is not None:
        config.setdefault("epp_callers", EPP_CALLERS)
    config.setdefault("tenants", TenantDirectory(TOKENS, allow_anonymous=anonymous))
    server = GatewayServer(GatewayConfig(workers=workers, host="127.0.0.1", port=0,
                                         **config)).start()
    try:
        yield server
    finally:
        server.drain()


class Caller:
    """Stubs of a gateway; `meta(token)` is the metadata a tenant's calls carry."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.compute = pb_grpc.ComputeServiceStub(self.channel)
        self.gateway = gpb_grpc.GatewayServiceStub(self.channel)

    @staticmethod
    def meta(token: str | None = "tok-a", *extra: tuple[str, str]) -> list[tuple[str, str]]:
        auth = [("authorization", f"Bearer {token}")] if token else []
        return auth + list(extra)

    def generate(self, prompt: list[int] | str, token: str | None = "tok-a", *,
                 adapter: str = "", request_id: str = "", timeout: float = 10.0,
                 extra: tuple[tuple[str, str], ...] = ()) -> list[pb.GenerateResponse]:
        return list(self.stream(prompt, token, adapter=adapter, request_id=request_id,
                                timeout=timeout, extra=extra))

    def stream(self, prompt: list[int] | str, token: str | None = "tok-a", *, adapter: str = "",
               request_id: str = "", timeout: float = 10.0,
               extra: tuple[tuple[str, str], ...] = ()):
        return self.compute.Generate(request(prompt, adapter, request_id), timeout=timeout,
                                     metadata=self.meta(token, *extra))

    def close(self) -> None:
        self.channel.close()


def request(prompt: list[int] | str, adapter: str = "", request_id: str = "",
            max_tokens: int = 3) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, adapter=adapter,
                             sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req
