"""Mooncake-format traces: loading, hash id -> tokens, and a small synthetic trace generator.

A trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`;
each hash id names a block of 512 prompt tokens, and requests sharing leading ids share that
prefix. Here each id becomes a fixed block of token ids: SHAKE-256(seed, id) read as u32 and
reduced modulo the vocabulary, so equal ids give equal tokens in any process and any version.

    python -m prefixcache_bench.sim.trace --synth chat|rollout --out PATH [--requests N] [--seed S]

`scale_copies` scales a trace up to a fleet (issue 31: 1,000 workers): N copies of it, each a
tenant of its own, on one timeline. A copy keeps the original's requests (`source`: the
original's position) and block ids; what makes it a tenant of its own is its pages: copy k's page
hashes are the original's XORed with a 16-byte mask of k (`copy_mask`, zero for copy 0), as a
tenant salt gives another namespace seed and so other hashes for the same tokens
(prefixcache_client.hash.namespace_seed). The mask is a bijection, so within a copy every
sharing of the original is kept, and copies share no page, not even the system prompt every
request of the conversation trace opens with (id 0): a fleet of that size serves many
applications, each with its own system prompt, rather than one prompt cached by all. Two copies
meet only where two original pages differ by exactly the XOR of two masks (odds ~2^-128 a pair,
those of two salted hashes colliding). Each original prompt is then hashed once, and a copy's
hashes cost one numpy XOR (`CopyHashes`) instead of SHA-256 over every page of every copy,
which was most of a scaled run's time outside the gateway. Copy k arrives `k x spacing_s`
later than the original (0.5 s by default: 125 copies spread over ~1 min of an hour-long trace),
so that copies do not send their simultaneous requests (several at t=0) as one N-fold burst,
while the load per worker of N copies over N x W workers stays that of one copy over W workers.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import heapq
import json
import random
import struct
import sys
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefixcache_client.hash import chain_hashes, namespace_seed

BLOCK_TOKENS = 512


@dataclass(slots=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    copy: int = 0  # which copy of the trace (scale_copies), 0 when not scaled
    source: int = 0  # the original request's position in arrival order (its own when not scaled)


def load_trace(path: str | Path, max_requests: int | None = None, time_scale: float = 1.0,
               max_output_tokens: int = 4096, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """Requests in arrival order. time_scale > 1 compresses time (more load); outputs are capped."""
    if time_scale <= 0:
        raise ValueError(f"time_scale: must be > 0, got {time_scale}")
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if max_requests is not None and len(out) >= max_requests:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            ids, n = tuple(int(h) for h in rec["hash_ids"]), int(rec["input_length"])
            if n < 1 or n > len(ids) * block_tokens:
                raise ValueError(f"{path}:{lineno}: input_length {n} does not fit {len(ids)} blocks")
            out.append(TraceRequest(len(out), float(rec["timestamp"]) / 1000.0 / time_scale, n,
                                    min(max(int(rec["output_length"]), 1), max_output_tokens), ids))
    out.sort(key=lambda r: (r.arrival_s, r.index))
    for i, r in enumerate(out):
        r.source = i
    return out


def scale_copies(requests: Sequence[TraceRequest], copies: int, spacing_s: float = 0.5,
                 max_requests: int | None = None) -> list[TraceRequest]:
    """`copies` disjoint copies of `requests` (see the module docstring) merged in arrival order,
    ties in copy order, re-indexed from 0; the first `max_requests` of the merged timeline."""
    if copies < 1 or spacing_s < 0:
        raise ValueError(f"copies must be >= 1 and spacing_s >= 0, got {copies}, {spacing_s}")

    def copy_of(k: int) -> Iterator[tuple[float, int, int, TraceRequest]]:
        delay = k * spacing_s
        for i, r in enumerate(requests):
            yield r.arrival_s + delay, k, i, r

    out: list[TraceRequest] = []
    for arrival, k, i, r in heapq.merge(*(copy_of(k) for k in range(copies))):
        if max_requests is not None and len(out) >= max_requests:
            break
        out.append(TraceRequest(len(out), arrival, r.input_length, r.output_length, r.hash_ids, k, i))
    return out


@functools.lru_cache(maxsize=None)
def copy_mask(copy: int) -> np.ndarray:
    """The 16-byte mask of copy `copy`'s page hashes as two little-endian u64 (zero for copy 0,
    the trace itself): SHAKE-256 of the copy number, like a tenant's salt."""
    if copy == 0:
        return np.zeros(2, dtype="<u8")
    return np.frombuffer(hashlib.shake_256(struct.pack("<q", copy) + b"sim-copy").digest(16), dtype="<u8")


def copy_page_hashes(blob: bytes, copy: int) -> bytes:
    """The original's page hashes (concatenated 16-byte hashes) as copy `copy` has them."""
    if copy == 0:
        return blob
    return (np.frombuffer(blob, dtype="<u8").reshape(-1, 2) ^ copy_mask(copy)).tobytes()


class CopyHashes(Sequence[bytes]):
    """The page hashes of a scaled trace's requests, derived on access from the originals'
    (`blobs[r.source]`, hashed once): holding every copy's at once would take ~18 GB for 125
    copies of the conversation trace."""

    def __init__(self, requests: Sequence[TraceRequest], blobs: Sequence[bytes]) -> None:
        self.requests, self.blobs = requests, blobs

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        r = self.requests[i]
        return copy_page_hashes(self.blobs[r.source], r.copy)


class BlockTokens:
    """Deterministic tokens of trace blocks, with a small LRU of recent blocks."""

    def __init__(self, vocab_size: int = 128256, seed: int = 0, block_tokens: int = BLOCK_TOKENS,
                 cache_blocks: int = 8192) -> None:
        if not 1 <= vocab_size <= 2**32:
            raise ValueError(f"vocab_size: must be in [1, 2^32], got {vocab_size}")
        self.vocab_size, self.seed, self.block_tokens = vocab_size, seed, block_tokens
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cache_blocks = cache_blocks

    def block_bytes(self, hash_id: int) -> bytes:
        """The block's tokens as u32 little-endian bytes (what prefixcache_client.hash hashes)."""
        data = self._cache.get(hash_id)
        if data is not None:
            self._cache.move_to_end(hash_id)
            return data
        raw = hashlib.shake_256(struct.pack("<qq", self.seed, hash_id)).digest(4 * self.block_tokens)
        tokens = np.frombuffer(raw, dtype="<u4") % np.uint64(self.vocab_size)
        data = tokens.astype("<u4").tobytes()
        self._cache[hash_id] = data
        if len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return data

    def prompt_bytes(self, req: TraceRequest) -> bytes:
        return b"".join(self.block_bytes(h) for h in req.hash_ids)[: 4 * req.input_length]

    def prompt_tokens(self, req: TraceRequest) -> list[int]:
        return np.frombuffer(self.prompt_bytes(req), dtype="<u4").tolist()

    def page_hashes(self, req: TraceRequest, page_size: int, model_id: str, adapter: str = "",
                    salt: str = "") -> list[bytes]:
        """Hashes of the prompt's full pages in a namespace (prefixcache_client.hash's chain)."""
        return chain_hashes(namespace_seed(model_id, adapter, salt), self.prompt_bytes(req), page_size)


# ----- synthetic traces ------------------------------------------------------------------------

def _chat(n: int, rng: random.Random) -> Iterator[dict]:
    """Multi-turn chat: shared system prompts, conversations whose context grows every turn."""
    next_id = 0

    def new_ids(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    systems = [new_ids(rng.randint(1, 4)) for _ in range(16)]
    # (time ms, conversation, turns left, block ids of the context, its full blocks, its tokens)
    heap: list[tuple[float, int, int, list[int], int, int]] = []
    t = 0.0
    for conv in range(max(n // 4, 1)):
        t += rng.expovariate(1 / 900.0)  # a conversation starts every ~0.9 s
        sys_ids = systems[min(int(rng.paretovariate(1.2)) - 1, 15)]
        turns = 1 + int(rng.expovariate(1 / 4.0))
        heapq.heappush(heap, (t, conv, turns, sys_ids, len(sys_ids), len(sys_ids) * BLOCK_TOKENS))
    for _ in range(n):
        if not heap:
            return
        t, conv, turns, ids, kept, tokens = heapq.heappop(heap)
        user = int(rng.lognormvariate(6.5, 1.0)) + 16
        output = min(int(rng.lognormvariate(5.5, 0.8)) + 8, 2000)
        total = tokens + user
        # Blocks that were full in the previous prompt are unchanged; the rest is new content.
        ids = ids[:kept] + new_ids(-(-total // BLOCK_TOKENS) - kept)
        yield {"timestamp": int(t), "input_length": total, "output_length": output, "hash_ids": ids}
        if turns > 1:  # the answer joins the context; the user thinks ~30 s
            heapq.heappush(heap, (t + rng.expovariate(1 / 30000.0), conv, turns - 1, ids,
                                  total // BLOCK_TOKENS, total + output))


def _rollout(n: int, rng: random.Random) -> Iterator[dict]:
    """RL rollouts / agents: bursts of G samples of one long prompt, few-shot prefixes shared."""
    fewshot = [list(range(i * 8, i * 8 + rng.randint(2, 8))) for i in range(8)]
    next_id = 64
    t, out = 0.0, 0
    while out < n:
        t += rng.expovariate(1 / 2000.0)
        shared = fewshot[rng.randrange(len(fewshot))]
        task = rng.randint(1, 12)
        ids = shared + list(range(next_id, next_id + task))
        next_id += task
        length = (len(ids) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
        for _ in range(min(rng.choice((4, 8, 16)), n - out)):
            yield {"timestamp": int(t), "input_length": length,
                   "output_length": int(rng.lognormvariate(6.0, 0.7)) + 16, "hash_ids": ids}
            out += 1


SYNTH_KINDS = {"chat": _chat, "rollout": _rollout}


def write_synthetic(kind: str, path: str | Path, requests: int, seed: int = 0) -> int:
    if kind not in SYNTH_KINDS:
        raise ValueError(f"kind: unknown {kind!r}, expected one of {', '.join(SYNTH_KINDS)}")
    rng = random.Random(seed)
    rows = sorted(SYNTH_KINDS[kind](requests, rng), key=lambda r: r["timestamp"])
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixcache_bench.sim.trace",
                                     description="Generate a synthetic Mooncake-format trace.")
    parser.add_argument("--synth", required=True, choices=sorted(SYNTH_KINDS), help="workload kind")
    parser.add_argument("--out", required=True, help="output .jsonl path")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    n = write_synthetic(args.synth, args.out, args.requests, args.seed)
    print(f"wrote {n} requests to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
