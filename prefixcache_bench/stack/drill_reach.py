"""What a fault drill's L3 loss could have kept (prefixcache_bench.stack.fault_drill; issue 25,
finding 7): per prompt, the leading tokens some worker still held (device or host) when the
store came back, which the cache service's refill (cache_service/l3_refill.py) can write to L3
again, read from the gateway's index through RoutePreview. Everything of a prompt beyond that
and beyond what its conversation's previous turn sent after the loss was in no tier anywhere:
no refill can bring it back, only computing it again.

The drill's conversations repeat (after its last turn a conversation starts again with the same
prompts), so in the no-fault phase a prompt's new part (the tokens its previous turn did not
send) is an L3 hit too: its identical twin ran four turns earlier. After the store lost its
data that part is back only if a worker still held it (a 96-page pool holds the last few
conversations' pages, not the twin of four turns ago) or once the twin runs again. A real
conversation never resends a prompt, so this reuse is an artefact of the drill's loop; the
drill reports it apart (`reach_by_turn`) and judges the L3 share of each prompt's history (what
its previous turn sent), which a store loss need not lose after one turn.
"""
from __future__ import annotations

import pathlib

import grpc

from prefixcache.v1 import cache_service_pb2 as pb, cache_service_pb2_grpc as pbgrpc



def prompt_ids(tokenizer_json: pathlib.Path, prompts: list[str]) -> dict[str, list[int]] | None:
    """Prompt -> its token ids as the workers tokenize it (the demo checkpoint's tokenizer, BOS
    first); None when the model has no tokenizer.json there (--model smollm2: a GGUF)."""
    if not tokenizer_json.exists():
        return None
    from tokenizers import Tokenizer  # the workers' own tokenizer library
    tok = Tokenizer.from_file(str(tokenizer_json))
    return {p: tok.encode(p).ids for p in prompts}


def held_tokens(cache: str, pools: list[str], metadata,
                ids: dict[str, list[int]]) -> dict[str, int]:
    """Prompt -> its leading tokens held on some worker's device or host tier now: the longest
    run of whole pages of a pool's tree (its event stream's snapshot, exactly what the cache
    service holds; not the gateway's RoutePreview, whose routing memory also credits pages it
    only routed) that the prompt's token ids start with."""
    held: set[tuple[int, ...]] = set()
    page = 0
    for pool in pools:
        prefixes, size = _pool_prefixes(cache, pool, metadata)
        held.update(prefixes)
        page = size or page
    out = {}
    for prompt, tokens in ids.items():
        n = 0
        while page and len(tokens) >= n + page and tuple(tokens[:n + page]) in held:
            n += page
        out[prompt] = n
    return out


def _pool_prefixes(cache: str, pool: str, metadata) -> tuple[set[tuple[int, ...]], int]:
    """Every page of the pool's tree (no adapter) as the tokens from its namespace's start to
    the page's end, and the page size."""
    pages: dict[bytes, tuple[bytes, list[int]]] = {}  # hash -> (parent hash, page tokens)
    with grpc.insecure_channel(cache) as channel:
        stream = pbgrpc.CacheServiceStub(channel).Subscribe(
            pb.SubscribeRequest(pool_id=pool, epoch=0, after_seq=-1), metadata=metadata,
            timeout=10)
        for item in stream:
            if not item.HasField("batch"):
                continue
            for event in item.batch.events:
                if event.HasField("stored") and not event.stored.adapter:
                    _add_run(pages, event.stored)
                elif event.HasField("removed"):
                    for h in event.removed.block_hashes:
                        pages.pop(h, None)
            if item.batch.snapshot_end:
                stream.cancel()
                break
    memo: dict[bytes, tuple[int, ...]] = {}
    prefixes = {tuple(t) for h in pages if (t := _path(pages, h, memo)) is not None}
    return prefixes, max((len(p[1]) for p in pages.values()), default=0)


def _add_run(pages: dict, stored) -> None:
    size, parent = stored.block_size, stored.parent_block_hash
    for i, h in enumerate(stored.block_hashes):
        pages[h] = (parent, list(stored.token_ids[i * size:(i + 1) * size]))
        parent = h


def _path(pages: dict, h: bytes, memo: dict) -> list[int] | None:
    """The tokens from the namespace's start to page h's end; None when a parent is missing."""
    chain = []
    while h and h not in memo:
        if h not in pages:
            return None
        chain.append(h)
        h = pages[h][0]
    tokens = list(memo[h]) if h else []
    for page in reversed(chain):
        tokens += pages[page][1]
        memo[page] = tuple(tokens)
    return tokens


def split_prompt(counts: dict[str, int], new: int, held: int | None) -> dict[str, int]:
    """One request's prompt tokens split at its history (the tokens its conversation's previous
    turn sent too: the prompt's head) and its new part (the tail). Reuse is a prefix of the
    prompt: device, host and shared first, then L3, then what was computed; `held`: the leading
    tokens some worker held when the store came back (None: not measured)."""
    total = sum(counts.values())
    history = total - new
    local = counts["device"] + counts["host"] + counts["shared"]
    reused = local + counts["l3"]
    l3_history = max(0, min(reused, history) - local)
    out = {"history": history, "l3_history": l3_history, "new": new,
           "l3_new": counts["l3"] - l3_history, "reused_new": max(0, reused - history),
           "computed_history": history - min(reused, history)}
    if held is not None:
        held = min(held, total)
        out["held_new"] = max(0, held - history)
        out["computed_held"] = max(0, held - reused)  # held somewhere, yet computed
    return out
