"""`AffinityPolicy._extenders` (which workers' remembered pages can extend their index match)
against the walk it replaced: every matched worker and every worker remembering page 0 extended
page by page from where its device run stops."""
from __future__ import annotations

import random

import pytest

from gateway.core.index import Holders, PrefixMatch
from gateway.core.policies import make_policy


def _extended_by_walk(policy, matches, hashes, allowed):
    out = {}
    for w in dict.fromkeys([*matches, *policy.recent.holders(hashes[0])]):
        if w not in allowed:
            continue
        m = matches.get(w)
        start = m.device_pages if m is not None else 0
        end = policy.recent.extend(w, hashes, start)
        if end != start:
            out[w] = (start, end)
    return out


@pytest.mark.parametrize("seed", range(200))
def test_extenders_are_the_workers_the_walk_extends_in_its_order(seed):
    rng = random.Random(seed)
    policy = make_policy("affinity")
    workers = [f"w{i}" for i in range(rng.randint(1, 12))]
    pages = [bytes([i]) * 16 for i in range(12)]
    for _ in range(rng.randint(0, 30)):  # prompts routed: prefixes of a few shapes
        start = rng.choice([0, 0, 3])
        prompt = pages[:start] + rng.sample(pages[start:], rng.randint(1, 6))
        policy.recent.record(rng.choice(workers), prompt)
    hashes = pages[:rng.randint(1, 12)] if rng.random() < 0.7 else rng.sample(pages, 5)
    matches = {w: PrefixMatch(rng.randint(0, len(hashes)), 0, 0, 1.0)
               for w in rng.sample(workers, rng.randint(0, len(workers)))}
    allowed = set(rng.sample(workers, rng.randint(0, len(workers))))
    walk = _extended_by_walk(policy, matches, hashes, allowed)
    found = policy._extenders(Holders.from_matches(matches), hashes, allowed)
    assert [w for w, _ in found if policy.recent.extend(w, hashes, dict(found)[w]) > dict(found)[w]] \
        == [w for w, _ in found]  # every worker returned does extend
    assert [(w, s) for w, s in found] == [(w, walk[w][0]) for w in walk]
