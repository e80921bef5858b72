"""Benchmarks of the cache service, against the goals the design sets for it.

    python -m cache_service.bench [--quick] --json PATH [--trace PATH] [--server process|thread]

Parts (each a function returning a flat dict of metrics; `run` merges them):

- match:  in-process match + release of a fully cached 4,096-token prompt at page size 16, on the
          Pool itself and through `CacheCore.step` with one MatchOp.
- step:   batched Step RPCs over loopback gRPC (CacheClient -> server), 32 requests per step.
- events: page events delivered end to end to a gRPC subscriber (CacheClient.subscribe), and a
          check that the stream, applied to an empty set, reproduces the pool's page set.
- memory: tracemalloc bytes per cached page of the index (Pool filled with multi-turn chats).
- trace:  replay of a Mooncake conversation trace through CacheCore (match, allocate, publish,
          release per request): requests per second and hit ratio.

It prints a table (metric, value, goal, pass/fail) and writes every metric, the parameters and
the machine to --json. Progress goes to stderr. Everything random comes from one seed.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import hashlib
import io
import json
import math
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cache_service.client import CacheClient
from cache_service.core import CacheCore
from cache_service.pool import Pool, PoolConfig
from cache_service.server import CacheServer, ServerConfig
from cache_service.tree import DEVICE, children_of
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_bench import CONVERSATION_TRACE

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
TRACE_BLOCK_TOKENS = 512  # Mooncake traces: one hash id = 512 prompt tokens
PARTS = ("match", "step", "events", "memory", "trace")


@dataclass(slots=True)
class Params:
    """Everything that shapes a run; written to the JSON as `params`."""
    seed: int = 20240611
    page_size: int = 16
    vocab: int = 128_000
    server: str = "process"  # where the gRPC server runs: "process" (its own GIL) or "thread"
    # match: one 4,096-token prompt, plus siblings sharing its first `match_shared_tokens`.
    match_tokens: int = 4096
    match_siblings: int = 63
    match_shared_tokens: int = 1024
    match_iters: int = 5000
    # step: 32 requests per Step; prompts = a shared system prefix + a per-request tail.
    step_batch: int = 32
    step_prefix_tokens: int = 1024
    step_tail_tokens: tuple[int, int] = (512, 1024)
    step_prompts: int = 256
    step_iters: int = 2000
    step_pool_pages: int = 65_536
    # events: rounds of `event_requests` new prompts of `event_prompt_pages` pages, in a pool
    # small enough that eviction (BlockRemoved) runs as much as publishing (BlockStored).
    event_pages: int = 500_000
    event_requests: int = 16
    event_prompt_pages: int = 64
    event_pool_pages: int = 8192
    # memory: multi-turn chats over shared system prompts until this many pages are cached.
    mem_pages: int = 50_000
    mem_hits: int = 5000  # then this many pure hits, for memory kept per request
    # trace replay
    trace_path: str = str(CONVERSATION_TRACE)
    trace_requests: int | None = None  # None = the whole trace
    trace_device_tokens: int = 1_000_000
    trace_host_tokens: int = 0
    warmup: int = 50
    parts: tuple[str, ...] = PARTS
    profile: bool = False

    @classmethod
    def quick(cls) -> Params:
        return cls(match_iters=1000, step_iters=300, event_pages=60_000, mem_hits=2000,
                   trace_requests=2000, warmup=20)


GOALS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "match_4k_us_p50": ("<= 200", lambda v: v <= 200),
    "step_rpc_32_ms_p50": ("<= 2", lambda v: v <= 2),
    "events_per_s": (">= 50000", lambda v: v >= 50_000),
    "events_lost": ("== 0", lambda v: v == 0),
    "events_index_mismatch": ("== 0", lambda v: v == 0),
    "bytes_per_page": ("<= 300", lambda v: v <= 300),
}


# ---- small helpers ------------------------------------------------------------------------

def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty sample."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(prefix: str, samples: list[float], scale: float) -> dict[str, float]:
    """p50/p99/mean of `samples` (seconds) in the unit `scale` converts to."""
    return {f"{prefix}_p50": round(percentile(samples, 0.50) * scale, 3),
            f"{prefix}_p99": round(percentile(samples, 0.99) * scale, 3),
            f"{prefix}_mean": round(sum(samples) / len(samples) * scale, 3)}


class Progress:
    """Rate-limited progress lines on stderr, so long parts show they are alive."""

    def __init__(self, label: str, total: int, every_s: float = 2.0):
        self.label, self.total, self.every_s = label, total, every_s
        self.start = self.last = time.perf_counter()

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            rate = done / (now - self.start)
            print(f"  {self.label}: {done:,}/{self.total:,} ({rate:,.0f}/s)", file=sys.stderr,
                  flush=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Tokens:
    """Seeded random token ids, as u32 numpy arrays (cheap to turn into bytes or lists)."""

    def __init__(self, seed: int, vocab: int):
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def random(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab, n, dtype=np.uint32)

    def uniform(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def register(pool_id: str, p: Params, device_pages: int,
             host_pages: int = 0) -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(pool_id=pool_id, epoch=1, page_size=p.page_size,
                                  device_pages=device_pages, host_pages=host_pages,
                                  model_id=MODEL, lease_ttl_s=600)


# ---- the Pool and the core, in process ----------------------------------------------------

def serve_on_pool(pool: Pool, lease_id: str, data: bytes) -> int:
    """One request on a bare Pool: match, allocate the rest, publish every full page, release.
    Returns the cached pages it matched. The pool's pending events are dropped (no core here)."""
    ps = pool.cfg.page_size
    n = len(data) // 4
    hit = len(pool.match("r", lease_id, "", "", data, 600.0, False, False).device_pages)
    lease = pool.leases[lease_id]
    need = ceil_div(n, ps) - hit
    if need > 0 and not pool.allocate(lease, need).ok:
        raise RuntimeError(f"bench pool too small for a {n}-token prompt")
    pool.publish(lease, b"", n // ps)
    pool.release(lease)
    pool.take_events()  # drop them (no subscriber here); also resets per-call memos
    return hit


class CoreSteps:
    """One request at a time through `CacheCore.step` (or a CacheClient's `step`)."""

    def __init__(self, step: Callable[[pb.StepRequest], pb.StepResponse], pool_id: str,
                 page_size: int):
        self.step, self.pool_id, self.page_size = step, pool_id, page_size

    def req(self, **ops) -> pb.StepRequest:
        return pb.StepRequest(pool_id=self.pool_id, epoch=1, **ops)

    def serve(self, match: pb.MatchOp, n_tokens: int) -> tuple[int, bool]:
        """Match, allocate the uncached pages, publish every full page and release.
        Returns (cached tokens, allocation ok)."""
        m = self.step(self.req(matches=[match])).matches[0]
        need = ceil_div(n_tokens, self.page_size) - len(m.device_pages)
        ok = True
        if need > 0:
            ok = self.step(self.req(allocations=[pb.AllocateOp(lease_id=m.lease_id,
                                                               num_pages=need)])).allocations[0].ok
        publishes = [pb.PublishOp(lease_id=m.lease_id, computed_pages=n_tokens // self.page_size)]
        self.step(self.req(publishes=publishes if ok else [],
                           releases=[pb.ReleaseOp(lease_id=m.lease_id)]))
        return m.cached_tokens, ok


def bench_match(p: Params) -> dict:
    """Latency of matching a fully cached 4,096-token prompt (255 pages: the last token is always
    computed), on the Pool (match + release of the lease) and through CacheCore.step (one
    MatchOp; the release runs in an untimed step)."""
    tok = Tokens(p.seed, p.vocab)
    prompt = tok.random(p.match_tokens)
    siblings = [np.concatenate([prompt[:p.match_shared_tokens],
                                tok.random(p.match_tokens - p.match_shared_tokens)])
                for _ in range(p.match_siblings)]
    pages = p.match_tokens // p.page_size + 1
    data = prompt.tobytes()

    cfg = PoolConfig("match", 1, p.page_size, pages * (p.match_siblings + 2), 0, 0, MODEL, 600.0)
    pool = Pool(cfg, 1, time.monotonic)
    for i, other in enumerate([prompt, *siblings]):
        serve_on_pool(pool, f"fill{i}", other.tobytes())
    expected = (p.match_tokens - 1) // p.page_size
    samples = []
    for i in range(p.warmup + p.match_iters):
        lease_id = f"l{i}"
        start = time.perf_counter()
        result = pool.match("r", lease_id, "", "", data, 600.0, False, False)
        pool.release(pool.leases[lease_id])
        elapsed = time.perf_counter() - start
        if len(result.device_pages) != expected:
            raise RuntimeError(f"match hit {len(result.device_pages)} pages, expected {expected}")
        if i >= p.warmup:
            samples.append(elapsed)
    out = summarize("match_4k_us", samples, 1e6)
    out["match_4k_pages"] = expected

    core = CacheCore()
    core.register_pool(register("match", p, cfg.device_pages))
    steps = CoreSteps(core.step, "match", p.page_size)
    for other in [prompt, *siblings]:
        steps.serve(pb.MatchOp(token_ids=other.tolist()), len(other))
    req = steps.req(matches=[pb.MatchOp(request_id="r", token_ids=prompt.tolist())])
    samples = []
    for i in range(p.warmup + p.match_iters):
        start = time.perf_counter()
        resp = core.step(req)
        elapsed = time.perf_counter() - start
        core.step(steps.req(releases=[pb.ReleaseOp(lease_id=resp.matches[0].lease_id)]))
        if i >= p.warmup:
            samples.append(elapsed)
    out.update(summarize("match_4k_core_step_us", samples, 1e6))
    return out


# ---- gRPC server ---------------------------------------------------------------------------

@dataclass(slots=True)
class ServerHandle:
    target: str
    pid: int | None  # the server process, for its CPU time; None when in a thread

    def cpu_s(self) -> float | None:
        """User + system CPU seconds of the server process so far (Linux /proc)."""
        if self.pid is None:
            return None
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cache_server(mode: str) -> Iterator[ServerHandle]:
    """A cache server on 127.0.0.1 (any free port): `python -m cache_service` in a child process
    (as deployed: the server has its own interpreter lock), or a CacheServer in this process."""
    if mode == "thread":
        server = CacheServer(CacheCore(), ServerConfig(host="127.0.0.1", port=0, grace_s=0.0))
        server.start()
        try:
            yield ServerHandle(f"127.0.0.1:{server.port}", None)
        finally:
            server.drain()
        return
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cache_service", "--host", "127.0.0.1", "--port", "0",
             "--log-level", "WARNING", "--grace-s", "0", "--metrics-port", "0"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            line = proc.stdout.readline()
            if not line.startswith("listening on "):
                proc.wait(10)
                errors.seek(0)
                raise RuntimeError(f"cache server did not start: {line!r}\n{errors.read()}")
            yield ServerHandle(f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}", proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()


# ---- Step RPC -------------------------------------------------------------------------------

def bench_step_rpc(p: Params, server: ServerHandle) -> dict:
    """Two kinds of 32-request engine steps over loopback gRPC (client.step, request built
    beforehand; serialisation, transport and the server's work are timed).

    - step_rpc_32: 32 MatchOps of 1.5k-2k-token prompts that share a 1,024-token system prefix,
      fully cached (each pins ~95-127 pages), plus the ReleaseOps of the previous step's 32 leases.
    - step_rpc_32_mixed: 32 requests in four phases of a pipeline, 8 each: new prompts matched
      (1,024 cached prefix tokens + 513 new), allocations for those of the step before (33
      pages), publishes of those allocated before (96 pages, 32 new), releases.
    """
    tok = Tokens(p.seed + 1, p.vocab)
    out: dict = {"step_rpc_32_batch": p.step_batch}
    with CacheClient(server.target, timeout_s=30) as client:
        client.wait_until_ready(30)
        client.register_pool(register("step", p, p.step_pool_pages))
        prefix = tok.random(p.step_prefix_tokens)
        prompts = [np.concatenate([prefix, tok.random(tok.uniform(*p.step_tail_tokens))])
                   for _ in range(p.step_prompts)]
        # As the engine sends them: token ids packed as u32 bytes, no page hashes back.
        ops = [pb.MatchOp(request_id=f"r{i}", packed_token_ids=t.astype("<u4").tobytes(),
                          omit_page_hashes=True) for i, t in enumerate(prompts)]
        steps = CoreSteps(client.step, "step", p.page_size)
        for op, t in zip(ops, prompts):
            steps.serve(op, len(t))
        out.update(_timed_match_steps(p, client, steps, ops, server))
        client.register_pool(register("mixed", p, p.step_pool_pages))
        out.update(_timed_mixed_steps(p, client, tok, prefix, server))
    return out


def _timed_match_steps(p: Params, client: CacheClient, steps: CoreSteps, ops: list[pb.MatchOp],
                       server: ServerHandle) -> dict:
    pick = np.random.default_rng(p.seed + 2)
    held: list[str] = []
    samples, hit_pages, cpu0 = [], 0, None
    progress = Progress("step_rpc_32", p.warmup + p.step_iters)
    for i in range(p.warmup + p.step_iters):
        chosen = pick.choice(len(ops), p.step_batch, replace=False)
        req = steps.req(matches=[ops[j] for j in chosen],
                        releases=[pb.ReleaseOp(lease_id=lease) for lease in held])
        if i == p.warmup:
            cpu0 = server.cpu_s()
        start = time.perf_counter()
        resp = client.step(req)
        elapsed = time.perf_counter() - start
        held = [m.lease_id for m in resp.matches]
        if i >= p.warmup:
            samples.append(elapsed)
            hit_pages += sum(len(m.device_pages) for m in resp.matches)
        progress.update(i + 1)
    cpu1 = server.cpu_s()
    client.step(steps.req(releases=[pb.ReleaseOp(lease_id=lease) for lease in held]))
    out = summarize("step_rpc_32_ms", samples, 1e3)
    out["step_rpc_32_hit_pages_per_request"] = round(hit_pages / (p.step_iters * p.step_batch), 1)
    out["step_rpc_32_request_bytes"] = req.ByteSize()
    out["step_rpc_32_server_cpu_ms"] = (None if cpu0 is None or cpu1 is None
                                        else round((cpu1 - cpu0) / p.step_iters * 1e3, 3))
    return out


def _timed_mixed_steps(p: Params, client: CacheClient, tok: Tokens, prefix: np.ndarray,
                       server: ServerHandle) -> dict:
    quarter = p.step_batch // 4
    tail = 512 + 1  # one token past a page boundary: 33 pages to allocate, 96 to publish
    n_tokens = len(prefix) + tail
    steps = CoreSteps(client.step, "mixed", p.page_size)
    steps.serve(pb.MatchOp(token_ids=np.concatenate([prefix, tok.random(tail)]).tolist()),
                n_tokens)
    to_allocate: list[tuple[str, int]] = []  # (lease, pages it still needs)
    to_publish: list[str] = []
    to_release: list[str] = []
    samples, cpu0, failed = [], None, 0
    for i in range(p.warmup + p.step_iters):
        matches = [pb.MatchOp(request_id=f"m{i}.{k}", omit_page_hashes=True,
                              packed_token_ids=np.concatenate([prefix, tok.random(tail)])
                              .astype("<u4").tobytes()) for k in range(quarter)]
        req = steps.req(
            matches=matches,
            allocations=[pb.AllocateOp(lease_id=lease, num_pages=need)
                         for lease, need in to_allocate],
            publishes=[pb.PublishOp(lease_id=lease, computed_pages=n_tokens // p.page_size)
                       for lease in to_publish],
            releases=[pb.ReleaseOp(lease_id=lease) for lease in to_release])
        if i == p.warmup:
            cpu0 = server.cpu_s()
        start = time.perf_counter()
        resp = client.step(req)
        elapsed = time.perf_counter() - start
        # A lease whose allocation failed cannot publish: it goes straight to release.
        failed_now = [a.lease_id for a in resp.allocations if not a.ok]
        failed += len(failed_now)
        to_release = to_publish + failed_now
        to_publish = [a.lease_id for a in resp.allocations if a.ok]
        to_allocate = [(m.lease_id, ceil_div(n_tokens, p.page_size) - len(m.device_pages))
                       for m in resp.matches]
        if i >= p.warmup:
            samples.append(elapsed)
    cpu1 = server.cpu_s()
    client.step(steps.req(releases=[pb.ReleaseOp(lease_id=lease)
                                    for lease in [*(a for a, _ in to_allocate), *to_publish,
                                                  *to_release]]))
    out = summarize("step_rpc_32_mixed_ms", samples, 1e3)
    out["step_rpc_32_mixed_failed_allocations"] = failed
    out["step_rpc_32_mixed_server_cpu_ms"] = (None if cpu0 is None or cpu1 is None
                                              else round((cpu1 - cpu0) / p.step_iters * 1e3, 3))
    return out


# ---- events ---------------------------------------------------------------------------------

@dataclass
class EventIndex:
    """A subscriber's index: the stream applied to a set of (medium, page hash)."""
    pages: set[tuple[int, bytes]] = field(default_factory=set)
    received: int = 0  # page events (hashes in BlockStored/BlockRemoved) of live batches
    last_seq: int = -1
    last_at: float = 0.0
    gaps: int = 0
    snapshots: int = 0
    error: BaseException | None = None

    def apply(self, batch) -> None:
        if batch.snapshot:
            self.snapshots += batch.snapshot_end
        elif self.last_seq >= 0 and batch.seq != self.last_seq + 1:
            self.gaps += 1
        for ev in batch.events:
            kind = ev.WhichOneof("event")
            if kind == "stored":
                medium = ev.stored.medium
                self.pages.update((medium, h) for h in ev.stored.block_hashes)
                if not batch.snapshot:
                    self.received += len(ev.stored.block_hashes)
            elif kind == "removed":
                medium = ev.removed.medium
                self.pages.difference_update((medium, h) for h in ev.removed.block_hashes)
                if not batch.snapshot:
                    self.received += len(ev.removed.block_hashes)
            else:
                self.pages.clear()
        self.last_seq = batch.seq
        self.last_at = time.perf_counter()


def _consume(sub, index: EventIndex) -> None:
    try:
        for item in sub:
            if item.WhichOneof("item") == "batch":
                index.apply(item.batch)
    except BaseException as exc:  # reported in the results, never swallowed silently
        index.error = exc


def snapshot_pages(client: CacheClient, pool_id: str) -> set[tuple[int, bytes]]:
    """The pool's page set as the server's tree sees it, from a fresh snapshot."""
    index = EventIndex()
    with client.subscribe(pool_id, after_seq=-1) as sub:
        for item in sub:
            if item.WhichOneof("item") == "batch":
                index.apply(item.batch)
                if item.batch.snapshot_end:
                    break
    return index.pages


def bench_events(p: Params, server: ServerHandle) -> dict:
    """Page events per second from the first Step to the last batch delivered to a subscriber.

    Each round matches `event_requests` new prompts (unique first token, so every page is new),
    allocates, publishes and releases them; once the pool is full, allocation evicts as many
    pages as publishing stores, so the stream is about half BlockStored, half BlockRemoved.
    Generated = pages inserted (publish results) + pages evicted (stats); received = hashes in the
    live batches; and the subscriber's set must equal a fresh snapshot and the cached page count.
    """
    tok = Tokens(p.seed + 3, p.vocab)
    base = tok.random(p.event_prompt_pages * p.page_size + 1)
    n_tokens = len(base)
    with CacheClient(server.target, timeout_s=30) as client:
        client.wait_until_ready(30)
        client.register_pool(register("events", p, p.event_pool_pages))
        index = EventIndex()
        sub = client.subscribe("events", heartbeat_interval_s=0.1)
        consumer = threading.Thread(target=_consume, args=(sub, index), daemon=True)
        consumer.start()
        _wait(lambda: index.snapshots >= 1, 30, "the subscriber's initial snapshot")
        steps = CoreSteps(client.step, "events", p.page_size)
        need = ceil_div(n_tokens, p.page_size)
        # Once the pool is full every inserted page evicts one: generated ~ 2 * inserted - pool.
        target = (p.event_pages + p.event_pool_pages) // 2
        inserted, counter, progress = 0, 0, Progress("events", p.event_pages)
        start = time.perf_counter()
        while inserted < target:
            matches = []
            for _ in range(p.event_requests):
                counter += 1
                tokens = base.copy()
                tokens[0] = counter  # a new first page: every page of the prompt is new
                matches.append(pb.MatchOp(token_ids=tokens.tolist()))
            leases = [m.lease_id for m in steps.step(steps.req(matches=matches)).matches]
            steps.step(steps.req(allocations=[pb.AllocateOp(lease_id=lease, num_pages=need)
                                              for lease in leases]))
            resp = steps.step(steps.req(
                publishes=[pb.PublishOp(lease_id=lease, computed_pages=n_tokens // p.page_size)
                           for lease in leases],
                releases=[pb.ReleaseOp(lease_id=lease) for lease in leases]))
            inserted += sum(r.inserted_pages for r in resp.publishes)
            progress.update(max(inserted, 2 * inserted - p.event_pool_pages))
        produced_s = time.perf_counter() - start
        head = next(pool.head_seq for pool in client.list_pools().pools if pool.pool_id == "events")
        _wait(lambda: index.last_seq >= head or index.error is not None, 60,
              f"the subscriber to reach seq {head}")
        sub.close()
        consumer.join(10)
        generated = inserted + _evictions(client, "events")
        tree = snapshot_pages(client, "events")
        stats = client.get_stats(pb.GetStatsRequest(pool_id="events")).pools[0]
        cached = sum(m.cached_pages for m in stats.media)
    elapsed = index.last_at - start
    return {
        "events_per_s": round(index.received / elapsed) if elapsed > 0 else 0,
        "events_generated": generated,
        "events_received": index.received,
        "events_lost": generated - index.received,
        "events_index_mismatch": len(index.pages ^ tree) + abs(len(tree) - cached),
        "events_seq_gaps": index.gaps,
        "events_resnapshots": index.snapshots - 1,
        "events_batches": head,
        "events_produce_s": round(produced_s, 3),
        "events_deliver_s": round(elapsed, 3),
        "events_subscriber_error": None if index.error is None else repr(index.error),
    }


def _evictions(client: CacheClient, pool_id: str) -> int:
    stats = client.get_stats(pb.GetStatsRequest(pool_id=pool_id)).pools[0]
    return sum(m.evictions for m in stats.media)


def _wait(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)


# ---- index memory ---------------------------------------------------------------------------

def bench_memory(p: Params) -> dict:
    """Bytes of index per cached page: tracemalloc growth while a Pool fills with multi-turn
    chats (32 system prompts picked Zipf-like, 1-6 turns each, every turn's prompt the whole
    history), divided by the pages cached. Leases are released and events dropped, so what
    remains is the tree, its eviction heap and its bookkeeping."""
    slack = 64 * 1024  # pages beyond the target: no eviction while filling
    gc.collect()
    tracemalloc.start()
    try:
        before_pool = tracemalloc.get_traced_memory()[0]
        pool = Pool(PoolConfig("mem", 1, p.page_size, p.mem_pages + slack, 0, 0, MODEL, 600.0), 1,
                    time.monotonic)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        requests = _fill_with_chats(pool, p)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        cached = pool.cached[DEVICE]
        growth = _growth_per_hit(pool, p, p.mem_hits)
    finally:
        tracemalloc.stop()
    out = {
        "bytes_per_page": round((after - base) / cached, 1),
        "mem_cached_pages": cached,
        "mem_requests": requests,
        "mem_pool_bytes_per_device_page": round((base - before_pool) / pool.cfg.device_pages, 1),
        "mem_growth_bytes_per_hit": growth,
    }
    out.update(_memory_breakdown(pool, cached))
    return out


def _fill_with_chats(pool: Pool, p: Params) -> int:
    tok = Tokens(p.seed + 4, p.vocab)
    systems = [tok.random(tok.uniform(256, 2048)) for _ in range(32)]
    weights = np.array([1 / (i + 1) for i in range(len(systems))])
    weights /= weights.sum()
    requests = 0
    progress = Progress("memory", p.mem_pages)
    while pool.cached[DEVICE] < p.mem_pages:
        history = systems[int(tok.rng.choice(len(systems), p=weights))]
        for _ in range(tok.uniform(1, 6)):
            prompt = np.concatenate([history, tok.random(tok.uniform(64, 1024))])
            serve_on_pool(pool, f"mem{requests}", prompt.tobytes())
            requests += 1
            history = np.concatenate([prompt, tok.random(tok.uniform(64, 512))])
            if pool.cached[DEVICE] >= p.mem_pages:
                break
        progress.update(pool.cached[DEVICE])
    return requests


def _growth_per_hit(pool: Pool, p: Params, hits: int) -> float:
    """Memory kept per request that only hits (match + release of a cached prompt whose every
    full page is matched): nothing is cached anew, so anything kept is bookkeeping that grows
    with traffic rather than with the cache (e.g. stale eviction-heap entries)."""
    data = Tokens(p.seed + 5, p.vocab).random(128 * p.page_size + 1).tobytes()
    serve_on_pool(pool, "growth", data)
    gc.collect()
    start = tracemalloc.get_traced_memory()[0]
    for i in range(hits):
        pool.match("r", f"g{i}", "", "", data, 600.0, False, False)
        pool.release(pool.leases[f"g{i}"])
    gc.collect()
    return round((tracemalloc.get_traced_memory()[0] - start) / hits, 1)


def _memory_breakdown(pool: Pool, cached: int) -> dict:
    """Shallow sizes of the index's parts per cached page, to show where the bytes go."""
    nodes, dicts, branch = 0, 0, 0
    stack = [c for root in pool.roots.values() for c in children_of(root)]
    while stack:
        node = stack.pop()
        nodes += sys.getsizeof(node) + sys.getsizeof(node.key) + sys.getsizeof(node.hash)
        if isinstance(node.children, dict):
            dicts += sys.getsizeof(node.children)
            branch += 1
        stack.extend(children_of(node))
    heap_entries = sum(len(h) for h in pool._heaps.values())  # noqa: SLF001 (measuring internals)
    heap = sum(sys.getsizeof(h) for h in pool._heaps.values()) + heap_entries * (
        sys.getsizeof((0.0, 0, None)) + sys.getsizeof(1 << 40))
    return {
        "mem_node_key_hash_bytes_per_page": round(nodes / cached, 1),
        "mem_child_dict_bytes_per_page": round(dicts / cached, 1),
        "mem_branch_nodes": branch,
        "mem_lru_heap_entries": heap_entries,
        "mem_lru_heap_bytes_per_page": round(heap / cached, 1),
    }


# ---- trace replay ---------------------------------------------------------------------------

def block_tokens(hash_id: int, vocab: int) -> np.ndarray:
    """The 512 tokens of a trace hash id: SHAKE-256 of the id, read as u32, modulo the vocabulary.
    Equal ids give equal tokens in every run and process."""
    digest = hashlib.shake_256(b"prefixcache-bench-block" + hash_id.to_bytes(8, "little")).digest(
        4 * TRACE_BLOCK_TOKENS)
    return np.frombuffer(digest, dtype="<u4") % np.uint32(vocab)


def load_trace(path: str, limit: int | None) -> list[tuple[int, list[int]]]:
    """(input_length, hash_ids) of the first `limit` requests (all when None), in file order."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                rec = json.loads(line)
                ids = [int(h) for h in rec["hash_ids"]]
                out.append((min(int(rec["input_length"]), len(ids) * TRACE_BLOCK_TOKENS), ids))
    return out


def ideal_hit_tokens(trace: list[tuple[int, list[int]]], page_size: int) -> int:
    """Hit tokens with an unbounded cache: for each request, the pages that some earlier request
    already published (same hash ids up to that block and long enough to fill the page), up to
    the first miss and at most (n - 1) // page_size pages."""
    pages_per_block = TRACE_BLOCK_TOKENS // page_size
    trie: dict = {}  # hash id -> [pages of this block published so far, child trie]
    hits = 0
    for n, ids in trace:
        limit, full = (n - 1) // page_size, n // page_size
        node, hit, missed = trie, 0, False
        for b, h in enumerate(ids):
            entry = node.setdefault(h, [0, {}])
            lo = b * pages_per_block
            if not missed:
                have = min(entry[0], max(0, limit - lo))
                hit += have
                missed = have < min(pages_per_block, max(0, limit - lo))
            entry[0] = max(entry[0], min(pages_per_block, max(0, full - lo)))
            node = entry[1]
        hits += hit * page_size
    return hits


def bench_trace(p: Params) -> dict:
    """Replays the trace one request at a time through CacheCore.step: match, allocate the
    uncached pages, publish every full prompt page with the release. Only the three steps are
    timed (building the prompts is not)."""
    trace = load_trace(p.trace_path, p.trace_requests)
    core = CacheCore()
    device_pages = p.trace_device_tokens // p.page_size
    core.register_pool(register("trace", p, device_pages, p.trace_host_tokens // p.page_size))
    steps = CoreSteps(core.step, "trace", p.page_size)
    blocks: dict[int, np.ndarray] = {}
    busy, cpu, failed = 0.0, 0.0, 0
    progress = Progress("trace", len(trace))
    for i, (n, ids) in enumerate(trace):
        tokens = np.concatenate([_block(blocks, h, p.vocab) for h in ids])[:n]
        op = pb.MatchOp(request_id=str(i), token_ids=tokens.tolist())
        start, start_cpu = time.perf_counter(), time.thread_time()
        _, ok = steps.serve(op, n)
        busy += time.perf_counter() - start
        # CPU time too: on a shared machine, wall time also counts waiting for a core.
        cpu += time.thread_time() - start_cpu
        failed += not ok
        progress.update(i + 1)
    stats = core.get_stats(pb.GetStatsRequest(pool_id="trace")).pools[0]
    hits = stats.hit_tokens_device + stats.hit_tokens_host
    prompt_tokens = sum(n for n, _ in trace)
    return {
        "trace_requests": len(trace),
        "trace_ops_per_s": round(len(trace) / busy, 1),
        "trace_ms_per_request": round(busy / len(trace) * 1e3, 3),
        "trace_cpu_ms_per_request": round(cpu / len(trace) * 1e3, 3),
        "trace_prompt_tokens": prompt_tokens,
        "trace_hit_ratio": round(hits / stats.queried_tokens, 4) if stats.queried_tokens else 0.0,
        "trace_ideal_hit_ratio": round(ideal_hit_tokens(trace, p.page_size) / prompt_tokens, 4),
        "trace_device_pages": device_pages,
        "trace_evictions": sum(m.evictions for m in stats.media),
        "trace_failed_allocations": failed,
    }


def _block(cache: dict[int, np.ndarray], hash_id: int, vocab: int) -> np.ndarray:
    """Block tokens, cached for the blocks most reused (bounded: 182k distinct ids in the trace)."""
    block = cache.get(hash_id)
    if block is None:
        block = block_tokens(hash_id, vocab)
        if len(cache) < 20_000:
            cache[hash_id] = block
    return block


# ---- the run ----------------------------------------------------------------------------------

def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
    }
    with contextlib.suppress(Exception):
        from google.protobuf.internal import api_implementation
        import grpc
        info["protobuf_backend"] = api_implementation.Type()
        info["grpc"] = grpc.__version__
    with contextlib.suppress(Exception):
        git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True,  # noqa: E731
                                        text=True, timeout=10).stdout
        info["git_commit"] = git("rev-parse", "HEAD").strip()
        # Numbers depend on uncommitted changes to the service too: name them.
        info["git_modified"] = sorted(line[3:] for line in git(
            "status", "--porcelain", "--", "cache_service", "protos").splitlines()
            if not line.startswith("??"))
    return info


@contextlib.contextmanager
def maybe_profile(enabled: bool, label: str) -> Iterator[None]:
    """cProfile of the calling thread (not a server's), top entries by own time to stderr."""
    if not enabled:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        log(f"---- profile of {label} (tottime) ----\n{text.getvalue()}")


def run(p: Params) -> dict:
    """Every part in `p.parts`; a flat dict of metrics plus `params`, `machine`, `goals`."""
    results: dict = {}
    machine = machine_info()
    started = time.perf_counter()
    for part in ("match", "memory", "trace"):
        if part in p.parts:
            log(f"[{part}]")
            with maybe_profile(p.profile, part):
                t = time.perf_counter()
                results.update({"match": bench_match, "memory": bench_memory,
                                "trace": bench_trace}[part](p))
                results[f"{part}_s"] = round(time.perf_counter() - t, 2)
    if {"step", "events"} & set(p.parts):
        with cache_server(p.server) as server:
            for part, fn in (("step", bench_step_rpc), ("events", bench_events)):
                if part in p.parts:
                    log(f"[{part}] server={p.server} {server.target}")
                    with maybe_profile(p.profile, part):
                        t = time.perf_counter()
                        results.update(fn(p, server))
                        results[f"{part}_s"] = round(time.perf_counter() - t, 2)
    results["total_s"] = round(time.perf_counter() - started, 2)
    machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["goals"] = {key: {"goal": goal, "pass": check(results[key])}
                        for key, (goal, check) in GOALS.items() if key in results}
    results["params"] = dataclasses.asdict(p)
    results["machine"] = machine
    return results


def _fmt(value: object) -> str:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return f"{value:,}" if numeric else str(value)


def render_table(results: dict) -> str:
    """Metric, value, goal and pass/fail, one row per metric (goals first)."""
    rows = [(k, results[k], *GOALS[k][:1], "PASS" if results["goals"][k]["pass"] else "FAIL")
            for k in GOALS if k in results]
    skip = set(GOALS) | {"goals", "params", "machine"}
    rows += [(k, v, "", "") for k, v in results.items() if k not in skip]
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(_fmt(r[1])) for r in rows)
    lines = [f"{'metric':<{width}}  {'value':>{vwidth}}  {'goal':<9}  result",
             "-" * (width + vwidth + 22)]
    lines += [f"{k:<{width}}  {_fmt(v):>{vwidth}}  {g:<9}  {r}".rstrip() for k, v, g, r in rows]
    return "\n".join(lines)


SIZE_FLAGS = ("match_iters", "step_iters", "step_prompts", "event_pages", "mem_pages", "mem_hits",
              "trace_requests", "trace_device_tokens", "trace_host_tokens", "warmup")


def parse_args(argv: list[str] | None = None) -> tuple[Params, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m cache_service.bench",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer iterations and the first 2,000 trace requests (< 1 min)")
    ap.add_argument("--json", required=True, metavar="PATH", help="where to write the results")
    ap.add_argument("--trace", metavar="PATH", help=f"trace to replay (default {CONVERSATION_TRACE})")
    ap.add_argument("--server", choices=("process", "thread"),
                    help="run the gRPC server in a child process (default) or in this process")
    ap.add_argument("--only", metavar="PART[,PART]", help=f"subset of {','.join(PARTS)}")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile each part (this process's main thread) to stderr")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    # Sizes, mainly so that tests can run everything in seconds.
    for name in SIZE_FLAGS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    args = ap.parse_args(argv)
    p = Params.quick() if args.quick else Params()
    overrides = {name: getattr(args, name) for name in ("seed", "server", *SIZE_FLAGS)
                 if getattr(args, name) is not None}
    if args.trace:
        overrides["trace_path"] = args.trace
    if args.only:
        parts = tuple(s.strip() for s in args.only.split(",") if s.strip())
        unknown = set(parts) - set(PARTS)
        if unknown:
            ap.error(f"--only: unknown part(s) {', '.join(sorted(unknown))}; choose from {PARTS}")
        overrides["parts"] = parts
    overrides["profile"] = args.profile
    p = dataclasses.replace(p, **overrides)
    if p.step_prompts < p.step_batch:
        ap.error(f"--step-prompts: need at least {p.step_batch} (one step's batch)")
    return p, args


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    if "trace" in p.parts and not Path(p.trace_path).is_file():
        log(f"trace {p.trace_path} not found: pass --trace PATH or leave 'trace' out of --only")
        return 2
    results = run(p)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(render_table(results))
    print(f"\nwritten to {args.json}")
    # A missed goal is a result, not a failure of the tool; --check turns it into exit status 1.
    return 1 if args.check and not all(g["pass"] for g in results["goals"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
