"""RoutedPrefixes' two stores, the C one (csrc/routed_table.c) and DictPages (the reference),
given the same calls: every answer equal, after every call."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import index_native
from gateway.core.routed_prefixes import DictPages, RoutedPrefixes
from tests.gateway.helpers import page, pages


@pytest.fixture(scope="module", autouse=True)
def c_library():
    try:
        index_native.TABLE.library()
    except RuntimeError as exc:  # mode on and no compiler: said in the report
        pytest.skip(f"the gateway's C library cannot be built here: {exc}")
    if index_native.kernel() is None:
        pytest.skip(f"the gateway's C library is off or unavailable: {index_native.TABLE.reason}")


def pair(max_pages: int) -> tuple[RoutedPrefixes, RoutedPrefixes]:
    native, ref = RoutedPrefixes(max_pages, native=True), RoutedPrefixes(max_pages, native=False)
    assert isinstance(ref._pages, DictPages) and not isinstance(native._pages, DictPages)
    return native, ref


def same(native: RoutedPrefixes, ref: RoutedPrefixes, workers, probes) -> None:
    for hashes in probes:
        assert native.match(hashes) == ref.match(hashes)
        assert list(native.match(hashes).items()) == list(ref.match(hashes).items())
        for h in hashes[:3]:
            assert native.holders(h) == ref.holders(h)
    for w in workers:
        assert native.size(w) == ref.size(w), w
        for hashes in probes:
            for start in (0, 1, len(hashes) // 2):
                assert native.extend(w, hashes, start) == ref.extend(w, hashes, start)
    for hashes in probes:  # every worker at once (and one never seen), each from its own start
        asked = [*workers, "stranger"]
        starts = [i % 3 for i in range(len(asked))]
        ends = native.extend_many(asked, hashes, starts)
        assert ends == ref.extend_many(asked, hashes, starts)
        assert ends == [ref.extend(w, hashes, s) for w, s in zip(asked, starts)]


OPS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 4), st.integers(0, 40),
                         st.integers(0, 12)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), OPS)
def test_the_c_store_answers_as_the_dicts_do(max_pages, ops):
    native, ref = pair(max_pages)
    workers = [f"w{i}" for i in range(5)]
    probes = [pages(0, 8), pages(3, 20), pages(20, 41), [page(5), page(0), page(1)], []]
    for kind, w, start, n in ops:
        for routed in (native, ref):
            if kind == 0:
                routed.remove_worker(workers[w])
            else:  # a prompt: a shared root, then pages of its own
                routed.record(workers[w], pages(0, kind % 3) + pages(start, start + n))
        same(native, ref, workers, probes)


def test_many_workers_past_growth_and_eviction_keep_the_same_state():
    """Thousands of pages a worker through a small bound: the C tables grow several times and
    delete (backward shifts) on every record; then every page ever routed is compared."""
    native, ref = pair(300)
    rnd = random.Random(7)
    workers = [f"w{i}" for i in range(40)]
    seen = set()
    for step in range(3000):
        w = rnd.choice(workers)
        if step % 997 == 996:
            native.remove_worker(w), ref.remove_worker(w)
            continue
        root, start, n = rnd.randrange(4), rnd.randrange(20000), rnd.randrange(1, 40)
        hashes = pages(root * 10, root * 10 + 5) + pages(100 + start, 100 + start + n)
        native.record(w, hashes), ref.record(w, hashes)
        seen.update(range(100 + start, 100 + start + n))
    for i in list(range(40)) + sorted(seen):
        assert native.holders(page(i)) == ref.holders(page(i)), i
    for w in workers:
        assert native.size(w) == ref.size(w) <= 300
    for root in range(4):
        hashes = pages(root * 10, root * 10 + 5)
        assert native.match(hashes) == ref.match(hashes)
    assert native._pages.nbytes() > 0


def test_holder_masks_past_64_and_128_workers_match_as_the_dicts_do():
    """Pages many workers hold have a mask in C: masks made while the slots fit one word, then
    re-laid as workers pass 64 and 128, then thinned by evictions and removals."""
    native, ref = pair(40)
    rnd = random.Random(3)
    shared = pages(0, 30)
    for w in range(200):
        depth = rnd.randrange(1, 30)
        for routed in (native, ref):
            routed.record(f"w{w}", shared[:depth] + pages(1000 + 50 * w, 1000 + 50 * w + 5))
        if w % 37 == 36:
            probe = [shared, shared[:5], shared[3:], [page(1000 + 50 * w)] + shared]
            same(native, ref, [f"w{v}" for v in range(0, w + 1, 7)], probe)
    for w in range(0, 200, 3):
        native.remove_worker(f"w{w}"), ref.remove_worker(f"w{w}")
    for w in range(1, 200, 5):  # evicts the shared pages from these workers' memory
        hashes = pages(50000 + 100 * w, 50000 + 100 * w + 40)
        native.record(f"w{w}", hashes), ref.record(f"w{w}", hashes)
    same(native, ref, [f"w{v}" for v in range(200)], [shared, shared[:1], shared[10:20]])
    assert len(native.match(shared)) > 64


def test_a_removed_workers_slot_is_reused_empty():
    native, ref = pair(8)
    for routed in (native, ref):
        routed.record("a", pages(0, 4))
        routed.record("b", pages(0, 2))
        routed.remove_worker("a")
        routed.record("c", pages(10, 12))  # takes a's slot
    same(native, ref, ["a", "b", "c"], [pages(0, 4), pages(10, 12)])
    assert native.match(pages(10, 12)) == {"c": 2} and native.size("a") == 0


def test_native_on_without_the_library_refuses():
    before = index_native.TABLE.mode, index_native.TABLE.cache_dir
    index_native.configure("off", before[1])
    try:
        with pytest.raises(RuntimeError, match="no C library"):
            RoutedPrefixes(4, native=True)
        assert isinstance(RoutedPrefixes(4)._pages, DictPages)
    finally:
        index_native.configure(*before)


@pytest.mark.parametrize("policy", ["affinity", "approx", "sglang", "round_robin"])
def test_the_gauges_say_what_the_policy_remembers_and_its_memory(policy):
    import prometheus_client

    from gateway.core.metrics import GatewayMetrics
    from gateway.core.policies import make_policy
    from gateway.core.router import Router
    from gateway.core.routed_prefixes import DICT_BYTES_PER_PAGE
    metrics = GatewayMetrics()
    router = Router(make_policy(policy), metrics)
    stores = [getattr(router.policy, name) for name in ("recent", "routed")
              if hasattr(router.policy, name)]
    for i, routed in enumerate(stores):
        routed.record("a", pages(0, 10 + i))
        routed.record("b", pages(0, 4))
    want = sum(14 + i for i in range(len(stores)))
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert f"prefixcache_gateway_routed_pages {float(want)}" in text
    nbytes = sum(r._pages.nbytes() for r in stores)
    assert metrics.registry.get_sample_value("prefixcache_gateway_routed_memory_bytes") == nbytes
    for routed in stores:  # the C store counts its own; the dicts' is an estimate
        if isinstance(routed._pages, DictPages):
            assert routed._pages.nbytes() == routed._pages.pages() * DICT_BYTES_PER_PAGE
        else:
            assert routed._pages.nbytes() > 0
            assert routed._pages.pages() == routed.size("a") + routed.size("b")
