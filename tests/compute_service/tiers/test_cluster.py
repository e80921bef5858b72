"""L3 on a real 3-master Redis Cluster (tests/redis_cluster.py): pages written by one worker are
loaded by another across hash slots (one pipelined round trip per master, never a cross-slot
MGET), and a master killed mid-run makes only its own slots miss: every request still finishes
with the cold output."""
from __future__ import annotations

import pytest

from pagestore.client import L3Client
from prefixcache_client.hash import prompt_hashes
from tests.compute_service.tiers.helpers import (PAGE, PROMPT, generate, l3_client, prompt_of,
                                                 reference)

FAMILIES = ["tiny-transformer", "tiny-hybrid"]


def count_round_trips(monkeypatch) -> list[int]:
    """Counts L3Client pipelines (each is one round trip to one node)."""
    calls = [0]
    real = L3Client._pipeline

    def counted(self, conn, build):
        calls[0] += 1
        return real(self, conn, build)

    monkeypatch.setattr(L3Client, "_pipeline", counted)
    return calls


@pytest.mark.parametrize("name", FAMILIES)
def test_worker_b_loads_what_worker_a_wrote_through_the_cluster(redis_cluster, workers, name,
                                                                monkeypatch):
    l3 = l3_client(redis_cluster.url, timeout_s=1.0)
    a = workers(name, l3, l3_write_policy="write-through")
    cold, _ = generate(a, PROMPT)
    assert cold == reference(name, tuple(PROMPT)) and a.flush_l3()
    hashes = prompt_hashes(PROMPT, PAGE, name)
    masters = {redis_cluster.master_of(l3.key(name, h)) for h in hashes}
    assert len(masters) >= 2  # the prompt's pages span masters: a single MGET would fail
    b = workers(name, l3_client(redis_cluster.url, timeout_s=1.0), lookup=True)
    trips = count_round_trips(monkeypatch)
    toks, s = generate(b, PROMPT)
    assert toks == cold and s.cached_tokens_remote == 32 and s.computed_prompt_tokens == 1
    # One probe and one load (8 pages < one batch), each one round trip per master.
    assert trips[0] == 2 * len(masters)
    m = b.tier_metrics()
    assert m["l3_load_pages_ok"] == 8 and m["l3_up"] == 1 and m["l3_breaker_open"] == 0


def test_a_master_killed_mid_run_misses_only_its_slots(own_redis_cluster, workers):
    cluster, name = own_redis_cluster, "tiny-transformer"
    prompts = [prompt_of(40 + i, 33) for i in range(4)]
    writer = l3_client(cluster.url, timeout_s=1.0)
    a = workers(name, writer, l3_write_policy="write-through")
    for p in prompts:
        generate(a, p)
    assert a.flush_l3() and a.tier_metrics()["l3_write_pages_failed"] == 0
    # The breaker's clock stands still: once open, the dead master's breaker stays open (no
    # half-open trial racing the assertions on a loaded machine).
    b = workers(name, l3_client(cluster.url, clock=lambda: 0.0, timeout_s=1.0), lookup=True)
    toks, s = generate(b, prompts[0])
    assert toks == reference(name, tuple(prompts[0])) and s.cached_tokens_remote == 32
    victim = cluster.master_of(writer.key(name, prompt_hashes(prompts[1], PAGE, name)[0]))
    cluster.kill(victim)
    hit_pages = 0
    for p in prompts[1:]:
        toks, s = generate(b, p)
        assert toks == reference(name, tuple(p))  # no request fails, the output is cold's
        on_victim = [cluster.master_of(writer.key(name, h)) == victim
                     for h in prompt_hashes(p, PAGE, name)]
        # The prefix found ends at the first page the dead master served; the others hit.
        first_dead = on_victim.index(True) if True in on_victim else len(on_victim)
        assert s.cached_tokens_remote == first_dead * PAGE
        hit_pages += first_dead
    m = b.tier_metrics()
    assert m["l3_up"] == 0 and m["l3_breaker_open"] == 2  # the dead master's breaker
    assert b.l3.client.breakers[f"127.0.0.1:{victim}"].state == "open"
    # Writes keep going to the live masters; the dead master's pages are counted as failed.
    more = prompt_of(99, 33)
    generate(a, more)
    assert a.flush_l3()
    wm = a.tier_metrics()
    dead = sum(cluster.master_of(writer.key(name, h)) == victim
               for h in prompt_hashes(more, PAGE, name))
    assert wm["l3_write_pages_ok"] >= 9 * 4 + 9 - dead - 1 and wm["l3_write_pages_failed"] >= 1
