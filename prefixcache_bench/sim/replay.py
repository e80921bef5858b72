"""Replay a Mooncake-format trace against a live gateway (or a single worker).

    python -m prefixcache_bench.sim.replay --trace PATH --target HOST:PORT [--time-scale X] [--max-requests N]
        [--max-output-tokens N] [--max-input-tokens N] [--block-tokens N] [--token AUTH]
        [--concurrency N] [--json PATH]

Each hash id becomes a deterministic block of token ids (prefixcache_bench.sim.trace), reduced into the
target's vocabulary (GetModelInfo); prompts are cut to their input_length (and to
--max-input-tokens and the target's context), outputs capped at --max-output-tokens and
generated to the end (ignore_eos). --block-tokens below 512 shrinks every block and
input_length alike: the trace's sharing structure with short prompts (small models, CPU).
Requests are sent at their arrival times divided by --time-scale, at most --concurrency at
once. Progress goes to stderr; a table to stdout and the same numbers as JSON to --json:
hit ratio (prompt tokens served from cache / prompt tokens, from the workers' final stats),
client-side TTFT p50/p99, and per worker: requests, prompt tokens (load) and cached tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from prefixcache_client.compute import ComputeClient
from gateway.core.tenants import AUTH_METADATA_KEY
from prefixcache_bench.sim.trace import BLOCK_TOKENS, BlockTokens, TraceRequest, load_trace
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache_bench.harness import Progress, columns_table, log, percentile, write_json
from service_shell import TlsConfig, add_tls_flags, channel_options, open_channel, tls_from_args


@dataclass(slots=True)
class Outcome:
    index: int
    code: str  # "OK" or the gRPC status code name
    ttft_s: float | None = None
    total_s: float = 0.0
    stats: pb.GenerateStats | None = None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prefixcache_bench.sim.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="Mooncake-format .jsonl trace")
    p.add_argument("--target", required=True, help="HOST:PORT of a gateway or a worker")
    p.add_argument("--time-scale", type=float, default=1.0, help="> 1 compresses arrivals")
    p.add_argument("--max-requests", type=int, help="replay the first N requests only")
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--max-input-tokens", type=int, help="cut every prompt to N tokens")
    p.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS,
                   help="tokens per trace block (input lengths scale with it)")
    p.add_argument("--token", help="bearer token sent as 'authorization: Bearer TOKEN'")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each request")
    p.add_argument("--seed", type=int, default=0, help="seed of the hash id -> tokens mapping")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_tls_flags(p)
    return p


def prompts(requests: list[TraceRequest], info: pb.GetModelInfoResponse, block_tokens: int,
            max_input: int | None, seed: int) -> list[list[int]]:
    """The token ids of every request, inside the target's vocabulary and context."""
    blocks = BlockTokens(vocab_size=info.vocab_size, seed=seed, block_tokens=block_tokens)
    out = []
    for req in requests:
        n = math.ceil(req.input_length * block_tokens / BLOCK_TOKENS)
        limit = info.max_context_tokens - req.output_length if info.max_context_tokens else n
        n = max(1, min(n, max_input or n, limit))
        out.append(blocks.prompt_tokens(dataclasses.replace(req, input_length=n)))
    return out


class ReplayProgress:
    """Completed requests and errors, from every sender thread, as harness progress lines."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.done = self.errors = 0
        self._lock = threading.Lock()
        self._lines = Progress("replay", total, out=(lambda _: None) if quiet else log)

    def update(self, ok: bool) -> None:
        with self._lock:
            self.done += 1
            self.errors += not ok
            self._lines.update(self.done, f"errors {self.errors}")


def _run_one(stub: pb_grpc.ComputeServiceStub, index: int, prompt: list[int], output: int,
             metadata: list[tuple[str, str]], timeout_s: float) -> Outcome:
    req = pb.GenerateRequest(request_id=f"replay-{index}-{time.time_ns()}",
                             sampling=pb.SamplingParams(max_tokens=output, ignore_eos=True))
    req.token_ids.ids.extend(prompt)
    start = time.monotonic()
    out = Outcome(index, "OK")
    try:
        for msg in stub.Generate(req, timeout=timeout_s, metadata=metadata):
            if out.ttft_s is None and msg.token_ids:
                out.ttft_s = time.monotonic() - start
            if msg.HasField("stats"):
                out.stats = msg.stats
    except grpc.RpcError as err:
        out.code = err.code().name
    out.total_s = time.monotonic() - start
    return out


def replay(stub: pb_grpc.ComputeServiceStub, requests: list[TraceRequest],
           token_ids: list[list[int]], *, concurrency: int, metadata: list[tuple[str, str]],
           timeout_s: float, progress: ReplayProgress) -> list[Outcome]:
    """Sends every request at its arrival time (at most `concurrency` in flight)."""
    slots = threading.BoundedSemaphore(concurrency)
    start = time.monotonic()
    futures = []

    def job(i: int) -> Outcome:
        try:
            out = _run_one(stub, i, token_ids[i], requests[i].output_length, metadata, timeout_s)
        finally:
            slots.release()
        progress.update(out.code == "OK")
        return out

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="replay") as pool:
        for i, req in enumerate(requests):
            delay = req.arrival_s - (time.monotonic() - start)
            if delay > 0:
                time.sleep(delay)
            slots.acquire()
            futures.append(pool.submit(job, i))
        return [f.result() for f in futures]


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    done = [o for o in outcomes if o.stats is not None]
    prompt = sum(o.stats.prompt_tokens for o in done)
    cached = {m: sum(getattr(o.stats, f"cached_tokens_{m}") for o in done)
              for m in ("device", "host", "remote")}
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    workers: dict[str, dict] = {}
    for o in done:
        w = workers.setdefault(o.stats.worker, {"requests": 0, "prompt_tokens": 0,
                                                "computed_prompt_tokens": 0, "cached_tokens": 0})
        w["requests"] += 1
        w["prompt_tokens"] += o.stats.prompt_tokens
        w["computed_prompt_tokens"] += o.stats.computed_prompt_tokens
        w["cached_tokens"] += (o.stats.cached_tokens_device + o.stats.cached_tokens_host
                               + o.stats.cached_tokens_remote)
    for w in workers.values():
        w["hit_ratio"] = w["cached_tokens"] / w["prompt_tokens"] if w["prompt_tokens"] else 0.0
        w["load_share"] = w["prompt_tokens"] / prompt if prompt else 0.0
    return {
        "requests": len(outcomes), "completed": len(done),
        "errors": dict(Counter(o.code for o in outcomes if o.code != "OK")),
        "duration_s": duration_s, "prompt_tokens": prompt,
        "cached_tokens": {**cached, "total": sum(cached.values())},
        "hit_ratio": sum(cached.values()) / prompt if prompt else 0.0,
        # None when no request produced a token (JSON null, "-" in the table).
        "ttft_p50_s": percentile(ttfts, 0.50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
        "workers": dict(sorted(workers.items())),
    }


def table(summary: dict) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f} ms"

    rows = [[name, w["requests"], w["prompt_tokens"], f"{w['load_share']:.1%}", w["cached_tokens"],
             f"{w['hit_ratio']:.3f}"] for name, w in summary["workers"].items()]
    return "\n".join([
        f"requests {summary['completed']}/{summary['requests']} completed, errors "
        f"{summary['errors'] or 0}, {summary['duration_s']:.1f} s",
        f"hit ratio {summary['hit_ratio']:.3f} ({summary['cached_tokens']['total']} of "
        f"{summary['prompt_tokens']} prompt tokens cached)",
        f"TTFT p50 {ms(summary['ttft_p50_s'])}  p99 {ms(summary['ttft_p99_s'])}", "",
        columns_table(["worker", "requests", "prompt tok", "load", "cached tok", "hit"], rows)])


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    tls: TlsConfig | None = tls_from_args(parser, args)
    if args.concurrency < 1 or not 1 <= args.block_tokens <= BLOCK_TOKENS:
        parser.error("--concurrency must be >= 1 and --block-tokens in [1, 512]")
    with ComputeClient(args.target, tls=tls, auth_token=args.token) as client:
        info = client.model_info()
    requests = load_trace(args.trace, args.max_requests, args.time_scale, args.max_output_tokens)
    token_ids = prompts(requests, info, args.block_tokens, args.max_input_tokens, args.seed)
    metadata = [(AUTH_METADATA_KEY, f"Bearer {args.token}")] if args.token else []
    channel = open_channel(args.target, channel_options(64), tls=tls)
    try:
        start = time.monotonic()
        outcomes = replay(pb_grpc.ComputeServiceStub(channel), requests, token_ids,
                          concurrency=args.concurrency, metadata=metadata,
                          timeout_s=args.timeout_s,
                          progress=ReplayProgress(len(requests), args.quiet))
        summary = summarize(outcomes, time.monotonic() - start)
    finally:
        channel.close()
    summary.update(target=args.target, trace=str(args.trace), model_id=info.model_id,
                   time_scale=args.time_scale, max_output_tokens=args.max_output_tokens)
    print(table(summary))
    if args.json:
        write_json(args.json, summary)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
