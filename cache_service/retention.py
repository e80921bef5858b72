"""Protection of retained prefixes: OpenAI's `prompt_cache_retention: "24h"` (design.md §4,
"Retained prefixes").

A request whose match asked for retention (MatchOp.retain_s > 0) has, when its lease ends, the
deepest run of its path pinned for min(retain_s, max_protect_s): a pinned run is never an
eviction candidate (allocator.Pages.is_candidate), and neither is any run above it while it
stays on device, so the whole prefix stays on device without any change to the eviction policy's
order. When the protection expires the pin goes and the run is offered to the eviction heap
again, ranked as its last use left it.

Bounded per namespace (a tenant's salt with the adapter; a cache_salt is a namespace of its own):
at most `pages_per_namespace` pages protected at once, counted as the protected path's pages, and
all namespaces together at most `max_pool_fraction` of the pool's device pages. A retained
request whose path would go beyond either is served as "in_memory" (not protected) and counted
in `ignored`. A path that extends a protected one (the next turn of a conversation)
takes over its protection: the shorter one's pages are given back first, so a conversation is
charged its longest path, not the sum of its turns.

Not thread-safe: the core's lock, as the rest of a pool.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from cache_service.tree import Node, Root


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    # Pages one namespace may keep protected at once; 0: retention is never honoured.
    pages_per_namespace: int = 0
    # The longest a run stays protected, whatever the request asked (24 h for "24h").
    max_protect_s: float = 600.0
    # Protected pages of all namespaces together, as a fraction of the pool's device pages:
    # without it many tenants within their budgets could leave running requests no pages (the
    # hints bench, prefixcache_bench/sim/hints.py, found allocations failing at 88%).
    max_pool_fraction: float = 0.5

    def __post_init__(self) -> None:
        if (self.pages_per_namespace < 0 or not self.max_protect_s > 0
                or not 0 <= self.max_pool_fraction <= 1):
            raise ValueError("retention: pages_per_namespace must be >= 0, max_protect_s > 0 and "
                             "max_pool_fraction in [0, 1]")


@dataclass(slots=True, eq=False)
class _Protection:
    node: Node
    pages: int
    until: float


class Retention:
    """The protected runs of one pool, their per-namespace page budget and their expiry."""

    def __init__(self, config: RetentionConfig, device_pages: int, pin: Callable[[Node], None],
                 unpin: Callable[[Node], None]) -> None:
        self.config = config
        self._pool_limit = int(config.max_pool_fraction * device_pages)
        self._pin, self._unpin = pin, unpin
        self._by_node: dict[Node, _Protection] = {}
        self._pages: dict[Root, int] = {}  # protected pages per namespace
        self._expiry: list[tuple[float, int, _Protection]] = []
        self._tie = itertools.count()
        self.protected_requests = 0
        self.ignored = 0  # retained requests beyond their namespace's budget

    def nodes(self) -> list[Node]:
        """The pinned runs (the deepest of each protected path)."""
        return list(self._by_node)

    @property
    def protected_pages(self) -> int:
        return sum(self._pages.values())

    def protect(self, path: list[Node], retain_s: float, now: float) -> bool:
        """Protects the path (root first) of a retained request until now + retain_s (bounded
        by max_protect_s). False, counted, when its namespace's budget has no room."""
        if not path:
            return False
        deepest, root = path[-1], path[-1].root
        pages = sum(len(n.pages) for n in path if n.pages is not None)
        covered = [self._by_node[n] for n in path if n in self._by_node]
        freed = sum(p.pages for p in covered)
        if (self._pages.get(root, 0) - freed + pages > self.config.pages_per_namespace
                or self.protected_pages - freed + pages > self._pool_limit):
            self.ignored += 1
            return False
        until = now + min(retain_s, self.config.max_protect_s)
        for p in covered:  # the new path holds what these held (they are its prefixes)
            if p.node is not deepest:
                self._release(p)
        held = self._by_node.get(deepest)
        if held is not None:
            self._pages[root] += pages - held.pages
            held.pages, held.until = pages, max(held.until, until)
        else:
            held = self._by_node[deepest] = _Protection(deepest, pages, until)
            self._pages[root] = self._pages.get(root, 0) + pages
            self._pin(deepest)
        heapq.heappush(self._expiry, (held.until, next(self._tie), held))
        self.protected_requests += 1
        return True

    def expire(self, now: float) -> int:
        """Ends the protections that are due; the number ended."""
        ended = 0
        heap = self._expiry
        while heap and heap[0][0] <= now:
            until, _, p = heapq.heappop(heap)
            if self._by_node.get(p.node) is p and p.until == until:
                self._release(p)
                ended += 1
        return ended

    def forget_namespace(self, root: Root) -> None:
        """The namespace was evicted: its runs are dead and their pins were recounted from the
        leases alone (pool.evict_namespace), so its protections end without unpinning."""
        for node in [n for n in self._by_node if n.root is root]:
            del self._by_node[node]
        self._pages.pop(root, None)

    def _release(self, p: _Protection) -> None:
        del self._by_node[p.node]
        root = p.node.root
        left = self._pages[root] - p.pages
        if left:
            self._pages[root] = left
        else:
            del self._pages[root]
        self._unpin(p.node)
