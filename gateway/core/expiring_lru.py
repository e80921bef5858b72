"""`ExpiringLru`: a map bounded by a budget, least recently stored (or refreshed) entries out
first, whose entries expire `ttl_s` after they were stored or last refreshed. The gateway's
memories of client hints use it: the workers of prompt-cache keys (cache_keys.py, one unit an
entry) and the token ids of answers (http/turns.py, an entry costs its ids). Not thread-safe:
its owner's lock."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ExpiringLru(Generic[K, V]):
    def __init__(self, budget: int, ttl_s: float, clock: Callable[[], float],
                 cost: Callable[[V], int] = lambda value: 1) -> None:
        self.budget, self.ttl_s, self._clock, self._cost = budget, ttl_s, clock, cost
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self.size = 0  # the entries' total cost
        self.dropped = 0  # entries dropped for the budget

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K, refresh: bool = False) -> V | None:
        """The value, or None (unknown, or expired: then dropped); `refresh` makes the entry the
        most recent and restarts its TTL."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value = entry
        now = self._clock()
        if expires <= now:
            self._discard(key)
            return None
        if refresh:
            self._entries[key] = (now + self.ttl_s, value)
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Stores `value` as the most recent entry, then drops the least recent ones while the
        total cost is over the budget."""
        self._discard(key)
        self._entries[key] = (self._clock() + self.ttl_s, value)
        self.size += self._cost(value)
        while self.size > self.budget:
            _, (_, old) = self._entries.popitem(last=False)
            self.size -= self._cost(old)
            self.dropped += 1

    def discard_where(self, predicate: Callable[[V], bool]) -> None:
        for key in [k for k, (_, v) in self._entries.items() if predicate(v)]:
            self._discard(key)

    def _discard(self, key: K) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.size -= self._cost(entry[1])
