"""What OpenTelemetry tracing costs decoding: decode tokens/s through the whole path (gateway
gRPC Generate -> worker -> cache service Step over gRPC) with tracing off and on.

    python -m prefixcache_bench.stack.tracing_overhead [--preset tiny-transformer] \
        [--streams 4] [--max-tokens 64] [--rounds 16] [--json PATH]

One process: a cache service, a worker (its Step calls over loopback gRPC), a gateway, and an
OTLP/gRPC trace receiver that counts the spans it is sent (the SDK's real exporter and batch
processor export to it, as they would to a collector). Each round sends --streams concurrent
Generate calls of --max-tokens tokens through the gateway and times them; rounds alternate off
and on (service_shell.tracing.enable), so both see the same machine. With tracing on, every
call has its gateway.Generate, worker.Generate and cache.Step spans, exported.

decode_tokens_per_s: generated tokens / the round's wall time (first call opened to last call
done), the median over the rounds of each mode. The ratio judged is the median over the rounds
of on / off within the round (the two halves of a round run back to back, so a neighbour's load
on a shared machine shifts both): decode_tokens_per_s_ratio_on_off, goal >= 0.97.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent import futures

import grpc
import torch
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig as CacheConfig
from compute_service.engine import Engine, EngineConfig
from compute_service.model import ByteTokenizer, build_preset
from compute_service.server import ServerConfig, serve
from gateway.assembly import GatewayConfig, GatewayServer
from gateway.core.discovery import WorkerAddress
from gateway.core.tenants import TenantDirectory
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache_bench.harness import Goal, log, machine_info, report
from prefixcache_client.cache import CacheClient
from service_shell import tracing

GOALS = {"decode_tokens_per_s_ratio_on_off": Goal(">=", 0.97)}


class SpanSink(otlp_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver that counts spans (what a collector's first hop does)."""

    def __init__(self):
        self.spans, self._lock = 0, threading.Lock()

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return otlp_pb.ExportTraceServiceResponse()


def _round(stub, streams: int, max_tokens: int, start: int) -> tuple[int, float]:
    def call(i: int) -> int:
        ids = [(start + 13 * i + 7 * k) % 250 + 1 for k in range(32)]  # a fresh prompt each
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True))
        req.token_ids.ids.extend(ids)
        return sum(len(m.token_ids) for m in stub.Generate(req, timeout=600))

    started = time.perf_counter()
    with futures.ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(call, range(streams)))
    return tokens, time.perf_counter() - started


def run(args: argparse.Namespace) -> dict:
    sink = SpanSink()
    receiver = grpc.server(futures.ThreadPoolExecutor(4))
    otlp_grpc.add_TraceServiceServicer_to_server(sink, receiver)
    otlp_port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    # A process has one tracer provider: this one, or the one already set (a test's).
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
        trace.set_tracer_provider(provider)
    processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{otlp_port}",
                                                    insecure=True))
    provider.add_span_processor(processor)

    cache = CacheServer(CacheCore(), CacheConfig(host="127.0.0.1", port=0, grace_s=0)).start()
    cache_address = f"127.0.0.1:{cache.port}"
    engine = Engine(build_preset(args.preset, seed=0), ByteTokenizer(),
                    CacheClient(cache_address, timeout_s=10),
                    EngineConfig(page_size=16, device_pages=2048, token_budget=512,
                                 max_running=max(8, args.streams), model_id=args.preset,
                                 pool_id="bench-worker"))
    worker = serve(engine, ServerConfig(host="127.0.0.1", port=0, grace_s=0))
    gw = GatewayServer(GatewayConfig(
        workers=lambda: [WorkerAddress(f"127.0.0.1:{worker.port}", cache_address)],
        host="127.0.0.1", port=0, grace_s=0.0, resolve_interval_s=0.2,
        tenants=TenantDirectory({}, allow_anonymous=True))).start()
    channel = grpc.insecure_channel(gw.address)
    stub = pb_grpc.ComputeServiceStub(channel)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    try:
        deadline = time.monotonic() + 30
        while not gw.router.ready():
            assert time.monotonic() < deadline, "the worker never became routable"
            time.sleep(0.1)
        _round(stub, args.streams, args.max_tokens, 0)  # warm-up, untimed
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                tracing.enable(mode == "on")
                tokens, seconds = _round(stub, args.streams, args.max_tokens, 1000 * r + 7)
                rates[mode].append(tokens / seconds)
            log(f"  round {r + 1}/{args.rounds}: off {rates['off'][-1]:.0f} tok/s, "
                f"on {rates['on'][-1]:.0f} tok/s")
        tracing.enable(False)
        processor.force_flush()
    finally:
        tracing.enable(False)
        channel.close()
        gw.drain()
        worker.drain()
        cache.drain()
        processor.shutdown()
        receiver.stop(0)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    paired = [b / a for a, b in zip(rates["off"], rates["on"])]
    return {"decode_tokens_per_s_off": round(off, 1), "decode_tokens_per_s_on": round(on, 1),
            "decode_tokens_per_s_ratio_on_off": round(statistics.median(paired), 3),
            "ratio_of_medians_on_off": round(on / off, 3),
            "rounds_off_tokens_per_s": [round(x, 1) for x in rates["off"]],
            "rounds_on_tokens_per_s": [round(x, 1) for x in rates["on"]],
            "spans_exported": sink.spans, "preset": args.preset, "streams": args.streams,
            "max_tokens": args.max_tokens, "rounds": args.rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixcache_bench.stack.tracing_overhead",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-transformer")
    ap.add_argument("--streams", type=int, default=4, help="concurrent Generate calls a round")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each call generates")
    ap.add_argument("--rounds", type=int, default=16, help="rounds, off and on alternating")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if min(args.streams, args.max_tokens, args.rounds) < 1:
        ap.error("--streams, --max-tokens and --rounds: must be at least 1")
    torch.set_num_threads(1)
    machine = machine_info(watched=["service_shell", "compute_service", "gateway"])
    log(f"[tracing overhead] {args.rounds} rounds of {args.streams} x {args.max_tokens} tokens, "
        "tracing off and on")
    results = run(args)
    report(results, GOALS, "decode tokens/s through the gateway: tracing off vs on",
           "python -m prefixcache_bench.stack.tracing_overhead " + " ".join(argv or sys.argv[1:]),
           machine, args.json)
    return 0  # a figure to report, not a gate


if __name__ == "__main__":
    raise SystemExit(main())
