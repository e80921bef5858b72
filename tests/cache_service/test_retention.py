"""Retained prefixes (cache_service/retention.py): a request with MatchOp.retain_s keeps its path
on device under eviction pressure, within its namespace's page budget and for a bounded time;
beyond the budget the hint is ignored and counted; expiry and namespace eviction end it."""
from __future__ import annotations

import pytest

from cache_service.core import CacheCore
from cache_service.retention import RetentionConfig
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from prefixcache_client.errors import CacheError, ErrorCode
from tests.cache_service.test_core import P, Worker

DAY = 86400.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _worker(pages_per_namespace: int = 8, max_s: float = 600.0, device: int = 16,
            pool_fraction: float = 0.5):
    clock = Clock()
    core = CacheCore(clock=clock,
                     retention=RetentionConfig(pages_per_namespace, max_s, pool_fraction))
    return Worker(core, device=device), clock


def _prompt(seed: int, pages: int = 4) -> list[int]:
    """pages full pages and one token more (the last token is always computed)."""
    return [seed * 1000 + i for i in range(pages * P + 1)]


def _run(w: Worker, tokens: list[int], salt: str = "", retain_s: float = 0.0) -> int:
    """Match, allocate, publish, release as an engine does; the tokens the match found."""
    ns = common_pb2.Namespace(salt=salt)
    m = w.step(matches=[pb.MatchOp(request_id="r", namespace=ns, token_ids=tokens,
                                   retain_s=retain_s)]).matches[0]
    need = -(-len(tokens) // P) - len(m.device_pages)
    assert w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=need)]).allocations[0].ok
    w.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=len(tokens) // P)])
    w.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])
    return m.cached_tokens


def _pressure(w: Worker, salt: str = "", rounds: int = 6) -> None:
    """New prompts enough to cycle the whole device pool several times."""
    for seed in range(50, 50 + rounds):
        _run(w, _prompt(seed), salt)


def test_a_retained_prefix_survives_device_eviction_pressure_and_a_plain_one_does_not():
    w, _ = _worker()
    _run(w, _prompt(1), retain_s=DAY)
    _run(w, _prompt(2))
    _pressure(w)
    assert _run(w, _prompt(1)) == 4 * P
    assert _run(w, _prompt(2)) == 0
    s = w.stats()
    assert (s.retained_pages, s.retained_requests, s.retention_ignored) == (4, 1, 0)
    assert s.media[0].evictions > 0
    assert s.media[0].pinned_pages == 4  # no request runs: the protection holds them


def test_beyond_the_namespace_budget_the_hint_is_ignored_and_counted():
    w, _ = _worker(pages_per_namespace=6)
    _run(w, _prompt(1), retain_s=DAY)           # 4 pages: within 6
    _run(w, _prompt(2), retain_s=DAY)           # 4 more: beyond, served as in_memory
    _run(w, _prompt(3), salt="t2", retain_s=DAY)  # another tenant: its own budget
    _pressure(w)
    assert _run(w, _prompt(1)) == 4 * P and _run(w, _prompt(3), salt="t2") == 4 * P
    assert _run(w, _prompt(2)) == 0
    s = w.stats()
    assert (s.retained_pages, s.retained_requests, s.retention_ignored) == (8, 2, 1)


def test_all_namespaces_together_stay_within_the_pool_fraction():
    w, _ = _worker(pages_per_namespace=8, pool_fraction=0.25)  # 4 of 16 device pages
    _run(w, _prompt(1), salt="t1", retain_s=DAY)
    _run(w, _prompt(2), salt="t2", retain_s=DAY)  # within t2's budget, beyond the pool's
    _pressure(w)
    assert _run(w, _prompt(1), salt="t1") == 4 * P and _run(w, _prompt(2), salt="t2") == 0
    s = w.stats()
    assert (s.retained_pages, s.retained_requests, s.retention_ignored) == (4, 1, 1)
    with pytest.raises(ValueError):
        RetentionConfig(max_pool_fraction=1.5)


def test_a_next_turn_takes_over_its_prefix_protection_instead_of_adding_to_it():
    w, _ = _worker(pages_per_namespace=8)
    first = _prompt(1)
    _run(w, first, retain_s=DAY)
    second = first[:-1] + [7] * (2 * P + 1)  # the same 4 pages, then 2 more
    assert _run(w, second, retain_s=DAY) == 4 * P
    s = w.stats()
    assert (s.retained_pages, s.retention_ignored) == (6, 0)
    _pressure(w)
    assert _run(w, second) == 6 * P


def test_protection_ends_after_the_bounded_time():
    w, clock = _worker(max_s=60.0)
    _run(w, _prompt(1), retain_s=DAY)  # asked 24 h, protected 60 s
    clock.now += 59.0
    _pressure(w)
    assert _run(w, _prompt(1)) == 4 * P and w.stats().retained_pages == 4
    clock.now += 2.0
    w.core.expire_leases()
    assert w.stats().retained_pages == 0
    _pressure(w)
    assert _run(w, _prompt(1)) == 0


def test_without_a_budget_nothing_is_protected_and_namespace_eviction_ends_protection():
    w, _ = _worker(pages_per_namespace=0)
    _run(w, _prompt(1), retain_s=DAY)
    assert (w.stats().retained_pages, w.stats().retention_ignored) == (0, 1)
    w, _ = _worker()
    _run(w, _prompt(1), salt="t", retain_s=DAY)
    free_before = w.device().free_pages
    w.core.evict_namespace(pb.EvictNamespaceRequest(
        pool_id=w.pool, namespace=common_pb2.Namespace(salt="t")))
    assert w.stats().retained_pages == 0 and w.device().free_pages == free_before + 4
    _pressure(w)  # the pool still works and its pages all cycle


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_retain_s_is_validated_naming_the_field(bad):
    w, _ = _worker()
    with pytest.raises(CacheError) as err:
        w.step(matches=[pb.MatchOp(request_id="r", token_ids=_prompt(1), retain_s=bad)])
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    assert "matches[0].retain_s" in str(err.value)
