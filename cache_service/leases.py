"""Leases: what a running request holds in a pool (design.md §2).

A lease holds the path of runs it matched or published, `deepest` being the last one (pinned,
see tree.py), and pages of its own beyond them. A lease's path ends at the end of `deepest`, and
`published` is its length in pages: `page_table[:published]` are the path's pages,
`page_table[published:]` are held by the lease alone (computed or being computed, not
published).
"""
from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field

from cache_service.tree import DEVICE, HOST, Node, PageView, Root, page_views, size
from prefixcache_client.errors import invalid, not_found
from prefixcache_client.limits import quote_untrusted


@dataclass(slots=True, eq=False)
class Lease:
    """`data` is the request's token sequence so far, as u32-le bytes (the match's own bytes
    until a publish appends to them). `dead_path` is set when the lease's namespace is evicted:
    the runs it still holds (deferred eviction, design.md lesson 5)."""
    lease_id: str
    root: Root
    data: bytes | bytearray
    page_table: array  # u32: the device page of each of the request's pages so far
    deepest: Node | None
    published: int
    ttl_s: float
    expires_at: float
    dead_path: list[Node] | None = None
    # MatchOp.retain_s: its path is protected this long when it ends (cache_service/retention.py).
    retain_s: float = 0.0
    _views: tuple | None = field(default=None, repr=False)

    @property
    def pages(self) -> list[int]:
        """The page table as a list (tests and introspection)."""
        return self.page_table.tolist()

    def path(self) -> list[Node]:
        """The runs of the lease's path, root first."""
        if self.dead_path is not None:
            return self.dead_path
        return path_to(self.deepest)

    @property
    def nodes(self) -> list[PageView]:
        """One view per published page of the path (tests and introspection). The same views
        while the path is unchanged, so that `view.parent is` the view before it holds across
        calls."""
        path = self.path()
        key = (self.dead_path is not None, *((id(n), size(n)) for n in path))
        if self._views is None or self._views[0] != key:
            self._views = (key, page_views(path, self.root))
        return list(self._views[1])


def path_to(node: Node | None) -> list[Node]:
    """The runs from a namespace root down to `node`, root first."""
    path = []
    while type(node) is Node:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def locate(lease: Lease, index: int) -> tuple[Node, int]:
    """The run of the lease's path holding its page `index` (< published), and the page's
    position in that run."""
    end, node = lease.published, lease.deepest
    while end - size(node) > index:
        end -= size(node)
        node = node.parent
    return node, index - (end - size(node))


def pinned_pages(leases, protected=()) -> dict[int, int]:
    """Cached pages on the paths of running requests and of the `protected` runs (retained
    prefixes, cache_service/retention.py), per medium, each counted once."""
    seen: set[Node] = set()
    counts = {DEVICE: 0, HOST: 0}
    deepest = [lease.deepest for lease in leases if not lease.root.dead]
    for node in deepest + [n for n in protected if not n.root.dead]:
        while type(node) is Node and node not in seen:
            seen.add(node)
            counts[node.medium] += size(node)
            node = node.parent
    return counts


class LeaseDirectory:
    """Every live lease id of one cache service and the pool it belongs to: new lease ids,
    and the lookup that tells an unknown lease from another pool's."""

    def __init__(self) -> None:
        self._pool_of: dict[str, str] = {}
        self._ids = itertools.count(1)

    def open(self, pool_id: str, epoch: int) -> str:
        lease_id = f"{pool_id}/{epoch}/{next(self._ids)}"
        self._pool_of[lease_id] = pool_id
        return lease_id

    def close(self, lease_id: str) -> None:
        self._pool_of.pop(lease_id, None)

    def find(self, leases: dict[str, Lease], pool_id: str, lease_id: str, where: str) -> Lease:
        """The pool's lease `lease_id` (`leases`: the pool's), or the error naming `where`."""
        held = leases.get(lease_id)
        if held is not None:
            return held
        owner = self._pool_of.get(lease_id)
        if owner is not None:
            raise invalid(f"{where}: lease '{lease_id}' belongs to pool '{owner}', "
                          f"not '{pool_id}'")
        # Quoted and cut: a lease id is the caller's string, unbounded on the wire.
        raise not_found(f"{where}: unknown or expired lease {quote_untrusted(lease_id)}")
