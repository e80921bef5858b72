"""`CacheKeyAffinity`: OpenAI's `prompt_cache_key` as a routing hint (design.md §6, "Prompt-cache
keys").

Requests of one tenant that carry the same key are sent to the worker the key's last request
went to, before the policy scores prefixes: a client that knows its requests share a prefix
(one conversation, one agent's system prompt) says so before the prefix is in any index, and
keeps saying so after its pages moved or aged out of the gateway's view. Bounded by load as the
prefix affinity is: when the key's worker is not a candidate (down, excluded, another tokenizer)
or its queue is over `max_queue_tokens` (or, the router's check, another candidate holds more of
the prompt on device), the policy decides as if there were no key and the key follows its
choice. The map is bounded (LRU over `max_keys`) and each entry expires `ttl_s`
after its last use, so a key that goes quiet stops pinning a worker.

Kept apart from the policies on purpose: the router consults it before `Policy.choose` and tells
it the outcome after, so a policy's scoring changes without touching key affinity.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.core.expiring_lru import ExpiringLru
from gateway.core.policies.load import LoadTracker

# (tenant scope, the client's key): keys are per tenant, never shared across tenants.
CacheKey = tuple[str, str]

ROUTE_REASON = "cache-key"


@dataclass(frozen=True, slots=True)
class CacheKeyConfig:
    # Keys remembered at once (least recently used first out). An entry is ~200 bytes.
    max_keys: int = 100_000
    # A key unused this long no longer pins its worker.
    ttl_s: float = 600.0
    # The key's worker keeps the key's requests while its queued prefill is at most this many
    # tokens: the same bound as the affinity policy's move_queue_tokens (two chunked-prefill
    # steps), so a key never piles work onto an overloaded worker.
    max_queue_tokens: float = 16384.0

    def __post_init__(self) -> None:
        if self.max_keys < 0 or not self.ttl_s > 0 or self.max_queue_tokens < 0:
            raise ValueError("max_keys must be >= 0, ttl_s > 0 and max_queue_tokens >= 0")


class CacheKeyAffinity:
    """Bounded map (tenant, key) -> worker with a TTL. Not thread-safe: the router's lock."""

    def __init__(self, config: CacheKeyConfig | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config or CacheKeyConfig()
        # The key's worker; it expires ttl_s after the key's last routed request.
        self._workers: ExpiringLru[CacheKey, str] = ExpiringLru(
            self.config.max_keys, self.config.ttl_s, clock or time.monotonic)

    def __len__(self) -> int:
        return len(self._workers)

    def worker_for(self, key: CacheKey, candidates: Sequence[str], load: LoadTracker) -> str | None:
        """The worker the key's requests go to now, or None (no key, expired, not a candidate,
        or over the load bound): then the policy decides."""
        worker = self._workers.get(key)
        if worker is None or worker not in candidates:
            return None
        if load.get(worker).queued_prefill_tokens > self.config.max_queue_tokens:
            return None
        return worker

    def record(self, key: CacheKey, worker: str) -> None:
        """The key's request was routed to `worker`: later ones follow it."""
        self._workers.put(key, worker)

    def remove_worker(self, worker: str) -> None:
        """The worker left: its keys go to whatever the policy picks next."""
        self._workers.discard_where(lambda w: w == worker)
