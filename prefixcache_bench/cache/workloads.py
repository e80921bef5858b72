"""The workloads the parts drive: seeded random prompts (`Tokens`), one request on a bare Pool or
through `CacheCore.step` (`serve_on_pool`, `CoreSteps`), and the Mooncake trace's prompts."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import numpy as np

from prefixcache_bench.cache.params import TRACE_BLOCK_TOKENS, ceil_div
from cache_service.pool import Pool
from prefixcache.v1 import cache_service_pb2 as pb


class Tokens:
    """Seeded random token ids, as u32 numpy arrays (cheap to turn into bytes or lists)."""

    def __init__(self, seed: int, vocab: int):
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def random(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab, n, dtype=np.uint32)

    def uniform(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))


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


# ---- the Mooncake trace ----------------------------------------------------------------------

def block_tokens(hash_id: int, vocab: int) -> np.ndarray:
    """The tokens of a trace hash id: SHAKE-256 of the id, read as u32, modulo the vocabulary.
    Equal ids give equal tokens in every run and process."""
    digest = hashlib.shake_256(b"prefixcache-bench-block" + hash_id.to_bytes(8, "little")).digest(
        4 * TRACE_BLOCK_TOKENS)
    return np.frombuffer(digest, dtype="<u4") % np.uint32(vocab)


class BlockCache:
    """Block tokens, kept for the first `limit` ids seen: bounded, since a trace can have far
    more distinct ids than are ever reused."""

    def __init__(self, vocab: int, limit: int = 20_000):
        self.vocab, self.limit, self.blocks = vocab, limit, {}

    def __call__(self, hash_id: int) -> np.ndarray:
        block = self.blocks.get(hash_id)
        if block is None:
            block = block_tokens(hash_id, self.vocab)
            if len(self.blocks) < self.limit:
                self.blocks[hash_id] = block
        return block


def _records(path: str, limit: int | None) -> list[dict]:
    """The first `limit` records (all when None) of a JSON-lines trace, in file order."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(json.loads(line))
    return out


def load_trace(path: str, limit: int | None) -> list[tuple[int, list[int]]]:
    """(input_length, hash_ids) of the first `limit` requests (all when None), in file order."""
    out = []
    for rec in _records(path, limit):
        ids = [int(h) for h in rec["hash_ids"]]
        out.append((min(int(rec["input_length"]), len(ids) * TRACE_BLOCK_TOKENS), ids))
    return out


def load_arrivals(path: str, limit: int | None) -> list[float]:
    """The arrival time (seconds) of each request load_trace returns, in the same order."""
    return [float(rec["timestamp"]) / 1000.0 for rec in _records(path, limit)]


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
