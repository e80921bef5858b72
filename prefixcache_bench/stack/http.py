"""What the OpenAI-compatible HTTP front costs: time to first token of a cached prompt through the
gateway's HTTP API and through its gRPC API, measured in the same run against the same stack.

    python -m prefixcache_bench.stack.http [--requests 200] [--json PATH]

Starts a cache service, one worker on the demo model (stack/demo_checkpoint.py) and the gateway
with both ports, caches one prompt, then sends it `--requests` times through each API, the two
alternating (and the order within a pair alternating), so that both see the same machine. Each
request streams; its TTFT is the arrival of the first generated text at this client. Both clients
keep one connection open (a gRPC channel, an HTTP keep-alive connection), as a real client does,
and no state is carried between timed calls but the prompt's cached pages, which both share.

The goal: the HTTP front adds at most 1 ms to the p50 TTFT (`http_overhead_p50_ms`, the
difference of the two p50s; `paired_overhead_p50_ms` is the median of per-pair differences).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import http.client
import urllib.parse

import grpc
import httpx

from prefixcache.v1 import compute_service_pb2 as pb, compute_service_pb2_grpc as pb_grpc
from prefixcache_bench.harness import (Goal, log, machine_info, percentile, report,
                                       summarize)
from stack.demo_checkpoint import write_demo_checkpoint
from stack.identities import write_credentials
from stack.launcher import Stack, free_port, python_module
from stack.workload import MODEL, SYSTEM

GOALS = {"http_overhead_p50_ms": Goal("<=", 1.0)}
PROMPT = SYSTEM + "What are your opening hours on Sunday?\nAssistant:"
NEW_TOKENS = 4


def grpc_ttft(stub: pb_grpc.ComputeServiceStub, i: int) -> float:
    req = pb.GenerateRequest(request_id=f"grpc-{i}", text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0))
    started = time.perf_counter()
    first = None
    for msg in stub.Generate(req, timeout=60):
        if first is None and msg.token_ids:
            first = time.perf_counter()
    if first is None:
        raise RuntimeError("gRPC: no token came back")
    return first - started


def _body(i: int) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "user": f"http-{i}"}


def _first_text(lines) -> float | None:
    """When the first SSE data line with generated text arrived (reads the stream to its end)."""
    first = None
    for line in lines:
        line = line.decode() if isinstance(line, bytes) else line
        data = line.removeprefix("data:").strip()
        if first is None and line.startswith("data:") and data != "[DONE]":
            if any(c.get("text") for c in json.loads(data).get("choices", [])):
                first = time.perf_counter()
    return first


def httpx_ttft(client: httpx.Client, i: int) -> float:
    """Through httpx, the client library the `openai` package uses."""
    started = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=_body(i)) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode()[:200]}")
        first = _first_text(resp.iter_lines())
    if first is None:
        raise RuntimeError("HTTP: no text came back")
    return first - started


def http_ttft(conn: http.client.HTTPConnection, i: int) -> float:
    """Through the standard library's HTTP/1.1 client: the front's own cost, with the least
    client of its own."""
    body = json.dumps(_body(i))
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode()[:200]}")
    first = _first_text(resp)
    if first is None:
        raise RuntimeError("HTTP: no text came back")
    return first - started


def start(stack: Stack, workdir: pathlib.Path, preset: str) -> tuple[str, str]:
    model = write_demo_checkpoint(workdir / MODEL, preset)
    auth = write_credentials(workdir, ["w1"])  # service authentication on, as deployed
    identities = ["--service-identities-file", str(auth.identities)]
    cache = f"127.0.0.1:{free_port()}"
    stack.start("cache_service", python_module("cache_service", "--host", "127.0.0.1", "--port",
                                               cache.rsplit(":", 1)[1], *identities), cache)
    worker = f"127.0.0.1:{free_port()}"
    stack.start("worker", python_module(
        "compute_service", "--model", str(model), "--cache-service", cache, "--pool-id", "w1",
        "--host", "127.0.0.1", "--port", worker.rsplit(":", 1)[1], "--threads", "1", *identities,
        "--service-token-file", str(auth.tokens["w1"])), worker)
    gateway, http_port = f"127.0.0.1:{free_port()}", free_port()
    stack.start("gateway", python_module(
        "gateway", "--host", "127.0.0.1", "--port", gateway.rsplit(":", 1)[1], "--workers",
        f"{worker}@{cache}", "--allow-anonymous", "--http-port", str(http_port),
        # A latency benchmark, back to back: not the tenants' rate limit.
        "--http-rate-per-s", "0", "--http-max-in-flight", "0",
        "--service-token-file", str(auth.tokens["gateway"])), gateway)
    return gateway, f"http://127.0.0.1:{http_port}"


def run(requests: int, preset: str, workdir: pathlib.Path) -> dict:
    stack = Stack(workdir)
    try:
        gateway, base_url = start(stack, workdir, preset)
        channel = grpc.insecure_channel(gateway)
        stub = pb_grpc.ComputeServiceStub(channel)
        client = httpx.Client(base_url=base_url, timeout=60)
        url = urllib.parse.urlsplit(base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        for i in range(3):  # caches the prompt; warms every path's connection
            grpc_ttft(stub, -1 - i)
            http_ttft(conn, -1 - i)
            httpx_ttft(client, -1 - i)
        grpc_s, http_s, httpx_s = [], [], []
        for i in range(requests):
            calls = [(grpc_s, lambda: grpc_ttft(stub, i)), (http_s, lambda: http_ttft(conn, i)),
                     (httpx_s, lambda: httpx_ttft(client, i))]
            for samples, call in calls[i % 3:] + calls[:i % 3]:  # the order rotates
                samples.append(call())
            if (i + 1) % 50 == 0:
                log(f"  {i + 1}/{requests} rounds")
        conn.close()
        client.close()
        channel.close()
    finally:
        stack.stop()
    out = {**summarize("grpc_ttft_ms", grpc_s, 1e3), **summarize("http_ttft_ms", http_s, 1e3),
           **summarize("httpx_ttft_ms", httpx_s, 1e3)}
    out["http_overhead_p50_ms"] = round(out["http_ttft_ms_p50"] - out["grpc_ttft_ms_p50"], 3)
    out["paired_overhead_p50_ms"] = round(
        percentile([h - g for h, g in zip(http_s, grpc_s, strict=True)], 0.5) * 1e3, 3)
    out["httpx_overhead_p50_ms"] = round(out["httpx_ttft_ms_p50"] - out["grpc_ttft_ms_p50"], 3)
    out["requests_per_api"] = requests
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixcache_bench.stack.http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="timed requests per API")
    ap.add_argument("--model", default="tiny-hybrid", help="tiny preset of the demo model")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error("--requests: must be at least 1")
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        log(f"[http vs grpc] {args.requests} cached-prompt requests through each API")
        results = run(args.requests, args.model, pathlib.Path(tmp))
    passed = report(results, GOALS, "TTFT of a cached prompt: HTTP vs gRPC",
                    "python -m prefixcache_bench.stack.http " + " ".join(argv or sys.argv[1:]), machine, args.json)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
