"""Redis losing its data (FLUSHALL, a restart that comes back empty): the cache service notices
(cache_service.l3_loss.StoreWatch, a sentinel key) and its pools write their pages to L3 again,
so another worker's next turn of a conversation loads its whole prefix from L3 (issue 25,
finding 7: only the pages published after the loss came back, and the other worker computed
the whole prompt)."""
from __future__ import annotations

import redis

from cache_service.l3_loss import StoreWatch
from tests.compute_service.tiers.helpers import (PAGE, PROMPT, generate, l3_client, prompt_of,
                                                 reference)

NAME = "tiny-transformer"


def _conversation_after_loss(redis_server, workers, lose) -> None:
    l3 = l3_client(redis_server.url, timeout_s=1.0, connect_timeout_s=1.0)
    watch = StoreWatch(l3)
    assert watch.check() is False  # arms the sentinel
    a = workers(NAME, l3, lookup=True, l3_write_policy="write-through")
    first, _ = generate(a, PROMPT)
    assert a.flush_l3()
    lose()
    assert watch.check() is True and watch.generation == 2
    assert watch.check() is False  # the sentinel is back: one loss, one bump
    # The next turn on the same worker: its prefix is on the device (no L3 involved) ...
    turn = PROMPT + first + prompt_of(2, 11)
    toks, stats = generate(a, turn)
    assert stats.cached_tokens_device >= len(PROMPT) - 1 and stats.cached_tokens_remote == 0
    assert a.flush_l3()
    # ... and another worker gets the whole of it from L3, the pages from before the loss too.
    b = workers(NAME, l3_client(redis_server.url), lookup=True)
    toks_b, stats_b = generate(b, turn)
    assert stats_b.cached_tokens_remote == (len(turn) - 1) // PAGE * PAGE
    assert toks_b == toks == reference(NAME, tuple(turn))


def test_after_flushall_pools_write_their_pages_to_l3_again(redis_server, workers):
    _conversation_after_loss(redis_server, workers,
                             lambda: redis.Redis.from_url(redis_server.url).flushall())


def test_after_redis_restarts_empty_pools_write_their_pages_to_l3_again(redis_server, workers):
    def restart() -> None:
        redis_server.stop()
        redis_server.start()
    _conversation_after_loss(redis_server, workers, restart)


def test_the_watch_changes_nothing_while_redis_is_down_or_intact(redis_server):
    l3 = l3_client(redis_server.url)
    watch = StoreWatch(l3)
    assert watch.check() is False and watch.check() is False
    redis_server.stop()
    assert watch.check() is None and watch.generation == 1
    redis_server.start()  # back empty: the sentinel is gone
    assert watch.check() is True and watch.generation == 2 and watch.losses == 1


def test_a_sentinel_whose_value_was_overwritten_counts_as_a_loss(redis_server):
    """Every value replaced (a restart from a damaged or foreign dump, the fault drill's
    redis-garbage): the keys are all there, the pages are not."""
    watch = StoreWatch(l3_client(redis_server.url))
    assert watch.check() is False
    r = redis.Redis.from_url(redis_server.url)
    r.set(watch.key, b"\x00" * r.strlen(watch.key))
    assert watch.check() is True and watch.generation == 2
    assert watch.check() is False  # written again with its own value
