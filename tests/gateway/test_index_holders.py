"""`KvIndex.holders` (a lookup's answer as arrays, runs found per group of slots: `run_ends`)
against the lookup it replaced (57fd6ba): runs slot by slot, a PrefixMatch and a confidence call
per holder. Same holders in the same order, same pages, same confidences, on random fleets with
every medium, stale workers and incomplete views; and the affinity policy's array path over them
chooses what the exhaustive scoring chooses on a fleet of many holders (test_policy_fast.py has
few)."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.index import KvIndex, PrefixMatch
from gateway.core.index_scan import bit_positions, held_masks, run_ends
from gateway.core.policies import AffinityPolicy, LoadTracker, RouteRequest
from tests.gateway.helpers import DEVICE, HOST, REMOTE, FakeClock, batch, cleared, page, stored
from tests.gateway.index_impls import table_impl  # noqa: F401  (C lookups by segments, then numpy)


def _old_runs(masks: list[int], starts: dict[int, int], first: int = 0) -> dict[int, int]:
    """index_scan.runs as it was: slot by slot."""
    joining: dict[int, int] = {0: first} if first else {}
    for slot, pos in starts.items():
        joining[pos] = joining.get(pos, 0) | (1 << slot)
    ends: dict[int, int] = {}
    if not joining:
        return ends
    alive, n = 0, len(masks)
    for i in range(min(joining), n):
        alive |= joining.pop(i, 0)
        if not alive:
            if not joining:
                return ends
            continue
        m = masks[i]
        if alive & m != alive:
            if i:
                for slot in bit_positions(alive & ~m):
                    ends[slot] = i
            alive &= m
    for pos, mask in joining.items():
        alive |= mask
    for slot in bit_positions(alive):
        ends[slot] = n
    return ends


def _old_others(everyone: int, ends: dict[int, int]) -> int:
    for slot in ends:
        everyone &= ~(1 << slot)
    return everyone


def _old_lookup(index: KvIndex, hashes: list[bytes], now: float) -> dict[str, PrefixMatch]:
    """KvIndex.lookup as it was."""
    dev, host, rem = index._tables
    everyone = index._all
    if not everyone or not hashes:
        return {}
    devm, hostm, remm = held_masks(dev, host if len(host) else None, rem if len(rem) else None,
                                   hashes, index.lookup_chunk_pages)
    if not devm:
        return {}
    dev_end = _old_runs(devm, {}, first=everyone)
    anym = devm if hostm is None else [d | h for d, h in zip(devm, hostm)]
    host_end = dev_end if hostm is None else _old_runs(anym, dev_end, first=_old_others(everyone, dev_end))
    rem_end = host_end if remm is None else _old_runs(
        [everyone if r else a for r, a in zip(remm, anym)], host_end,
        first=_old_others(everyone, host_end))
    out = {}
    for slot, r_end in rem_end.items():
        if r_end:
            d_end, h_end = dev_end.get(slot, 0), host_end.get(slot, 0)
            w = index._by_slot[slot]
            out[w.pool_id] = PrefixMatch(d_end, h_end - d_end, r_end - h_end, index._confidence(w, now))
    return out


def _fleet(rng: random.Random, workers: int, prefix: int):
    """Workers holding prefixes of one prompt (a shared system prompt's holders) and random
    pages, on random media; some stale, some with an incomplete view."""
    clock = FakeClock()
    index = KvIndex(clock=clock)
    index.lookup_chunk_pages = rng.choice([1, 3, 64])
    media = (DEVICE, HOST, REMOTE) if rng.random() < 0.5 else (DEVICE,)
    aging = rng.random() < 0.6  # else all fresh: incomplete views alone lower a confidence
    for w in range(workers):
        name = f"w{w:03d}"
        held = rng.choice([prefix, prefix, rng.randrange(prefix + 1)])
        events = [stored([page(i) for i in range(held) if rng.random() < 0.97], rng.choice(media))]
        if rng.random() < 0.3:
            events.append(stored([page(i) for i in range(rng.randrange(prefix + 4))
                                  if rng.random() < 0.8], rng.choice(media)))
        index.apply(batch(name, 0, *events))
        if rng.random() < 0.1:
            index.apply(batch(name, 5))  # a gap: its view is incomplete until a snapshot
        if rng.random() < 0.1:
            index.apply(batch(name, 0, cleared(), stored([page(0)]), epoch=2, snapshot=True))  # mid-snapshot
        if aging:
            clock.now += rng.choice([0.0, 0.0, 0.0, 1.0, 4.0, 12.0])  # the first ones go stale
    if rng.random() < 0.2:
        index.remove_worker(f"w{rng.randrange(workers):03d}")  # a free slot among the holders
    return clock, index


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_holders_equal_the_slot_by_slot_lookup(seed):
    rng = random.Random(seed)
    prefix = rng.randrange(1, 20)
    clock, index = _fleet(rng, rng.choice([1, 5, 40, 150]), prefix)
    for _ in range(5):
        hashes = [page(i) for i in range(rng.randrange(prefix + 6))]
        if rng.random() < 0.3:
            hashes = rng.sample(hashes, len(hashes))
        want = _old_lookup(index, hashes, clock.now)
        got = index.holders(hashes, clock.now)
        assert list(got.matches().items()) == list(want.items())  # the order too
        assert index.lookup(hashes, clock.now) == want
        assert got.device_pages.dtype.kind == "i" and got.confidence.dtype.kind == "f"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**40), max_size=12), st.integers(0, 2**40),
       st.dictionaries(st.integers(0, 39), st.integers(0, 14), max_size=20))
def test_run_ends_groups_what_runs_found_slot_by_slot(masks, first, starts):
    first &= ~sum(1 << s for s in starts)  # a slot starts once
    grouped: dict[int, int] = {}
    for slot, pos in starts.items():
        grouped[pos] = grouped.get(pos, 0) | 1 << slot
    got = {slot: end for end, mask in run_ends(masks, grouped, first).items()
           for slot in bit_positions(mask)}
    assert list(got.items()) == list(_old_runs(masks, starts, first).items())


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32))
def test_the_array_path_chooses_as_the_exhaustive_scoring_among_many_holders(seed):
    rng = random.Random(seed)
    prefix = rng.randrange(4, 16)
    twins = []
    for _ in range(2):
        clock, index = _fleet(random.Random(seed), 120, prefix)
        twins.append((clock, index, LoadTracker(clock), AffinityPolicy()))
    workers = tuple(sorted(twins[0][1].workers()))
    for n in range(10):
        hashes = [page(i) for i in range(prefix)] + [page(1000 + 100 * n + j) for j in range(prefix)]
        request = RouteRequest(f"q{n}", hashes, len(hashes) * 16 + 1, 16)
        fast = twins[0][3].choose(request, workers, twins[0][1], twins[0][2], all_scores=False)
        full = twins[1][3].choose(request, workers, twins[1][1], twins[1][2], all_scores=True)
        assert (fast.worker, fast.reason, fast.prefill_tokens) == (full.worker, full.reason,
                                                                   full.prefill_tokens)
        assert fast.scores == [s for s in full.scores if s.worker == full.worker]
        step = rng.random()
        for clock, _, load, _ in twins:
            load.on_route(fast.worker, request.request_id, fast.prefill_tokens)
            clock.now += step
