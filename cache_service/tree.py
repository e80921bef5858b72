"""The paged radix tree of one pool: one node per cached page, one virtual root per namespace.

Invariants (checked by tests/cache_service/test_core_properties.py):
- A node's `hash` is page_hash(parent.hash, key) and is set when the node is created (design.md lesson 3);
  a namespace root's `hash` is its namespace seed, so no two namespaces share a node or a hash.
- A node is in the tree iff `parent is not None`; removed nodes keep their page only while a lease
  still pins them (deferred namespace eviction, design.md lesson 5).
- The device region is prefix-closed: a DEVICE node's ancestors are all DEVICE. Demotion only takes
  device nodes without device children, and promotion goes top-down along a matched path.
- `pins` counts the leases whose path ends at the node (a lease pins only its deepest node; the
  ancestors are safe because they have a device child). Eviction never takes a node that is
  pinned or has a device child, so no page on a lease's path is evicted, demoted or freed. Dead
  nodes (an evicted namespace) count every lease whose path holds them instead.
"""
from __future__ import annotations

from collections.abc import Iterator

from prefixcache.v1 import common_pb2

DEVICE = common_pb2.MEDIUM_DEVICE
HOST = common_pb2.MEDIUM_HOST
NO_SLOT = -1


class Node:
    """One cached page. `children` is None, a single Node, or a dict keyed by the child's key:
    most nodes sit on a single chain, and a dict per node would triple the index memory."""

    __slots__ = ("key", "hash", "parent", "children", "page", "medium", "last_used", "pins", "slot",
                 "hits", "in_remote")

    def __init__(self, key: bytes, page_hash: bytes, parent: Node | Root, page: int, medium: int,
                 now: float):
        self.key = key
        self.hash = page_hash
        self.parent: Node | Root | None = parent
        self.children: Node | dict[bytes, Node] | None = None
        self.page = page
        self.medium = medium
        self.last_used = now
        self.pins = 0
        self.slot = NO_SLOT
        self.hits = 0  # matches that used this page (REMOTE_WRITE_POLICY_HOT)
        self.in_remote = False  # already written to L3 by this pool

    def __repr__(self) -> str:
        return f"Node({self.hash.hex()[:8]} page={self.page} medium={self.medium} pins={self.pins})"


class Root:
    """The virtual root of one namespace. Never evicted; replaced by a fresh root when the
    namespace is evicted (the old one is then `dead` until its last lease ends)."""

    __slots__ = ("hash", "children", "model_id", "adapter", "salt", "dead")

    def __init__(self, seed: bytes, model_id: str, adapter: str, salt: str):
        self.hash = seed
        self.children: Node | dict[bytes, Node] | None = None
        self.model_id = model_id
        self.adapter = adapter
        self.salt = salt
        self.dead = False


def child(parent: Node | Root, key: bytes) -> Node | None:
    kids = parent.children
    if kids is None:
        return None
    if type(kids) is Node:
        return kids if kids.key == key else None
    return kids.get(key)


def add_child(parent: Node | Root, node: Node) -> None:
    kids = parent.children
    if kids is None:
        parent.children = node
    elif type(kids) is Node:
        parent.children = {kids.key: kids, node.key: node}
    else:
        kids[node.key] = node


def remove_child(parent: Node | Root, node: Node) -> None:
    kids = parent.children
    if type(kids) is Node:
        parent.children = None
    else:
        del kids[node.key]
        if len(kids) == 1:
            parent.children = next(iter(kids.values()))
    node.parent = None


def children_of(parent: Node | Root) -> list[Node]:
    kids = parent.children
    if kids is None:
        return []
    if type(kids) is Node:
        return [kids]
    return list(kids.values())


def has_device_child(node: Node) -> bool:
    kids = node.children
    if kids is None:
        return False
    if type(kids) is Node:
        return kids.medium == DEVICE
    return any(k.medium == DEVICE for k in kids.values())


def walk(root: Root, data: bytes, stride: int, max_pages: int,
         known: list[Node] | None = None) -> list[Node]:
    """Nodes matching the leading full pages of `data` (u32-le tokens), at most `max_pages`;
    `known`: nodes already known to match its first pages, continued from."""
    path = list(known) if known else []
    node: Node | Root = path[-1] if path else root
    for start in range(len(path) * stride, min(len(data) // stride, max_pages) * stride, stride):
        kids = node.children
        if kids is None:
            break
        key = data[start:start + stride]
        if type(kids) is Node:
            if kids.key != key:
                break
            node = kids
        else:
            node = kids.get(key)
            if node is None:
                break
        path.append(node)
    return path


def common_pages(a: bytes, b: bytes, stride: int, limit: int) -> int:
    """Leading whole pages (of `stride` bytes) equal in a and b, at most `limit`: a binary
    search of C-speed comparisons instead of a page-by-page loop."""
    lo, hi = 0, min(len(a) // stride, len(b) // stride, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * stride] == b[:mid * stride]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def subtree(root: Node | Root) -> Iterator[Node]:
    """Every node below `root` (not root itself), parents before children."""
    stack = children_of(root)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(children_of(node))
