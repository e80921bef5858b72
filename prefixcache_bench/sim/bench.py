"""Micro-benchmarks of the routing path: decision latency (hashing included) and index ingest.

The index is populated like a busy fleet: every worker holds a few shared system prompts and
many private conversation prefixes on device, some extended on host; queries reuse a prefix
(system prompt, or a worker's conversation) and add new tokens, up to `prompt_tokens` in all.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from prefixcache_client.hash import prompt_hashes
from gateway.core.index import IndexConfig, KvIndex
from gateway.core.policies import AffinityPolicy, LoadTracker, RouteRequest
from prefixcache.v1 import common_pb2, events_pb2
from prefixcache_bench.harness import percentile

MODEL = "bench-model"


@dataclass(slots=True)
class BenchResult:
    workers: int
    prompt_tokens: int
    page_size: int
    decision_p50_us: float
    decision_p99_us: float
    # The same in thread CPU time: what a decision costs when no other process takes the core.
    decision_cpu_p99_us: float
    hash_p99_us: float
    lookup_p99_us: float
    ingest_page_events_per_s: float
    index_entries: int


def _stored(pool: str, seq: int, hashes: list[bytes], medium: int, page_size: int) -> events_pb2.EventBatch:
    ev = events_pb2.KvEvent(stored=events_pb2.BlockStored(block_hashes=hashes, block_size=page_size,
                                                          model_id=MODEL, medium=medium))
    return events_pb2.EventBatch(pool_id=pool, epoch=1, seq=seq, events=[ev])


def run_bench(workers: int = 64, prompt_tokens: int = 8192, page_size: int = 16, samples: int = 2000,
              prefixes_per_worker: int = 32, ingest_batches: int = 4000, seed: int = 0) -> BenchResult:
    rng = random.Random(seed)
    vocab = 128256
    index = KvIndex(IndexConfig(max_entries=50_000_000))
    names = [f"worker-{i:03d}" for i in range(workers)]
    seqs = dict.fromkeys(names, -1)

    def publish(name: str, hashes: list[bytes], medium: int) -> None:
        seqs[name] += 1
        index.apply(_stored(name, seqs[name], hashes, medium, page_size))

    systems = [[rng.randrange(vocab) for _ in range(rng.choice((512, 1024, 2048)))] for _ in range(4)]
    private: list[tuple[int, list[int]]] = []
    for w, name in enumerate(names):
        for system in systems:
            publish(name, prompt_hashes(system, page_size, MODEL), common_pb2.MEDIUM_DEVICE)
        for _ in range(prefixes_per_worker):
            tokens = rng.choice(systems) + [rng.randrange(vocab) for _ in range(prompt_tokens // 2)]
            hashes = prompt_hashes(tokens, page_size, MODEL)
            split = len(hashes) * 3 // 4
            publish(name, hashes[:split], common_pb2.MEDIUM_DEVICE)
            publish(name, hashes[split:], common_pb2.MEDIUM_HOST)
            private.append((w, tokens))
    load = LoadTracker()
    for name in names:
        load.report(name, common_pb2.LoadReport(queued_prefill_tokens=rng.randrange(50_000),
                                                running_requests=rng.randrange(16)))
    policy = AffinityPolicy()
    decision_us, cpu_us, hash_us, lookup_us = [], [], [], []
    for i in range(samples):
        # Each prompt is made just before its decision and dropped after it, as in a gateway:
        # thousands of retained token lists would make every full garbage collection walk them.
        base = rng.choice(systems) if rng.random() < 0.3 else rng.choice(private)[1]
        tokens = base + [rng.randrange(vocab) for _ in range(prompt_tokens - len(base))]
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        hashes = prompt_hashes(tokens, page_size, MODEL)
        t1 = time.perf_counter_ns()
        policy.choose(RouteRequest(str(i), hashes, len(tokens), page_size), names, index, load)
        t2 = time.perf_counter_ns()
        c2 = time.thread_time_ns()
        index.lookup(hashes)
        t3 = time.perf_counter_ns()
        decision_us.append((t2 - t0) / 1e3)
        cpu_us.append((c2 - c0) / 1e3)
        hash_us.append((t1 - t0) / 1e3)
        lookup_us.append((t3 - t2) / 1e3)
    return BenchResult(workers, prompt_tokens, page_size, percentile(decision_us, 0.5),
                       percentile(decision_us, 0.99), percentile(cpu_us, 0.99), percentile(hash_us, 0.99),
                       percentile(lookup_us, 0.99), bench_ingest(workers, page_size, rng, ingest_batches),
                       len(index))


def bench_ingest(workers: int, page_size: int, rng: random.Random, batches: int = 4000,
                 pages_per_batch: int = 64) -> float:
    """Page events per second through KvIndex.apply: store, demote and drop cycles per worker."""
    index = KvIndex(IndexConfig(max_entries=50_000_000))
    stream: list[events_pb2.EventBatch] = []
    seq = [-1] * workers
    live: list[list[list[bytes]]] = [[] for _ in range(workers)]
    for _ in range(batches):
        w = rng.randrange(workers)
        pool = f"worker-{w:03d}"
        seq[w] += 1
        if len(live[w]) < 8:
            hashes = [rng.randbytes(16) for _ in range(pages_per_batch)]
            live[w].append(hashes)
            stream.append(_stored(pool, seq[w], hashes, common_pb2.MEDIUM_DEVICE, page_size))
        else:
            hashes = live[w].pop(0)
            removed = events_pb2.KvEvent(removed=events_pb2.BlockRemoved(block_hashes=hashes,
                                                                          medium=common_pb2.MEDIUM_DEVICE))
            demoted = events_pb2.KvEvent(stored=events_pb2.BlockStored(block_hashes=hashes, block_size=page_size,
                                                                        model_id=MODEL,
                                                                        medium=common_pb2.MEDIUM_HOST))
            stream.append(events_pb2.EventBatch(pool_id=pool, epoch=1, seq=seq[w], events=[removed, demoted]))
    t0 = time.perf_counter()
    for batch in stream:
        index.apply(batch)
    elapsed = time.perf_counter() - t0
    return index.page_events / elapsed
