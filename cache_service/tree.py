"""The paged radix tree of one pool: path-compressed, one virtual root per namespace.

A `Node` owns a RUN of consecutive cached pages: their tokens as one bytes run, their page hashes
as one bytes run (16 bytes each) and their page numbers as one u32 array, so a cached page costs
its data and no Python object of its own. Every per-node attribute (medium, pins, last use, Mamba
slot, hits, written to L3) holds for the whole run; where that would stop being true the run is
split first (`split`): where a match ends, where a publish diverges from it, after a checkpointed
page, and where eviction or a partial load-back moves only part of it to another medium.
Eviction of a childless run's tail cuts it (`cut_tail`). Runs are never extended: a publish
below a run starts a new one, so a run's bytes objects stay as they were made (the event log
shares them) until a split or a cut replaces them.

Invariants (checked by tests/cache_service/test_core_properties.py through `PageView`s):
- Page hashes are set when a run enters the tree (design.md lesson 3): page i of a run is
  page_hash(hash of page i-1, its tokens), page 0 chaining from the parent's last page or, below
  a namespace root, from the root's `hash`, its namespace seed, so no two namespaces share a
  node or a hash.
- A node is in the tree iff `parent is not None`; removed nodes keep their pages only while a
  lease still pins them (deferred namespace eviction, design.md lesson 5).
- A node's children are keyed by their first page's tokens, so siblings differ in their first
  page and a lookup of the next page is one dict access.
- The device region is prefix-closed: a DEVICE node's ancestors are all DEVICE. Demotion only
  takes the tail of a device run without device children, and promotion goes top-down along a
  matched path.
- Every lease's path ends at the end of a node: a match or a publish that ends inside a run
  splits it there, and a split keeps the tail (with its children, pins and slot) in the old
  object, so a lease's deepest node stays its deepest node. `pins` counts the leases whose path
  ends at the node; the ancestors are safe because each has a device child on that path.
  Eviction never takes a node that is pinned or has a device child, so no page on a lease's
  path is evicted, demoted or freed. Dead nodes (an evicted namespace) count every lease whose
  path holds them instead.
- `slot` is the Mamba checkpoint of the run's LAST page: a checkpoint elsewhere splits the run,
  and a run that loses its last page loses its checkpoint.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterator

from prefixcache.v1 import common_pb2
from prefixcache_client.pages import common_pages

DEVICE = common_pb2.MEDIUM_DEVICE
HOST = common_pb2.MEDIUM_HOST
NO_SLOT = -1
HASH = 16  # bytes of one page hash
PAGE_CODE = "I"  # u32 page numbers, as on the wire


class Root:
    """The virtual root of one namespace. Never evicted; replaced by a fresh root when the
    namespace is evicted (the old one is then `dead` until its last lease ends)."""

    __slots__ = ("hash", "children", "model_id", "adapter", "salt", "dead")

    def __init__(self, seed: bytes, model_id: str, adapter: str, salt: str):
        self.hash = seed
        self.children: dict[bytes, Node] | None = None
        self.model_id = model_id
        self.adapter = adapter
        self.salt = salt
        self.dead = False


class Node:
    """A run of cached pages (see the module docstring). `queued`: the medium of the eviction
    heap holding this node's entry, or None (`allocator.Pages`)."""

    __slots__ = ("tokens", "hashes", "pages", "parent", "children", "root", "medium", "rank",
                 "used_at", "uses", "pins", "slot", "hits", "in_remote", "queued",
                 "superseded")

    def __init__(self, tokens: bytes, hashes: bytes, pages: array, parent: Node | Root,
                 root: Root, medium: int, now: float):
        self.tokens = tokens
        self.hashes = hashes
        self.pages: array | None = pages  # None once a dead node's pages are freed
        self.parent: Node | Root | None = parent
        self.children: dict[bytes, Node] | None = None
        self.root = root
        self.medium = medium
        # The eviction policy's rank (cache_service/eviction.py: smallest leaves first), the
        # last use and the number of uses it is computed from.
        self.rank = self.used_at = now
        self.uses = 0
        self.pins = 0
        self.slot = NO_SLOT
        self.hits = 0  # matches that used this run (REMOTE_WRITE_POLICY_HOT)
        self.in_remote = 0  # the L3 store generation it was written in (l3_loss), 0: never
        self.queued: int | None = None
        # A leaf a sibling branched off beside: a prompt's tail the next request did not
        # extend (cache_service/eviction.py, Adaptive.inserted).
        self.superseded = False

    def __repr__(self) -> str:
        return (f"Node({self.hashes[:4].hex()}.. pages={size(self)} medium={self.medium} "
                f"pins={self.pins})")


def size(node: Node) -> int:
    """Pages in the run."""
    return len(node.hashes) >> 4


def parent_hash(node: Node) -> bytes:
    """The hash the run chains from: its parent's last page, or the namespace seed."""
    parent = node.parent
    return parent.hash if type(parent) is Root else parent.hashes[-HASH:]


def event_parent(node: Node) -> bytes:
    """BlockStored.parent_block_hash of the run's first page: b"" at a namespace root."""
    parent = node.parent
    return b"" if type(parent) is Root else parent.hashes[-HASH:]


def add_child(parent: Node | Root, node: Node, stride: int) -> None:
    if parent.children is None:
        parent.children = {}
    parent.children[node.tokens[:stride]] = node


def remove_child(node: Node, stride: int) -> None:
    parent = node.parent
    kids = parent.children
    del kids[node.tokens[:stride]]
    if not kids:
        parent.children = None
    node.parent = None


def children_of(parent: Node | Root) -> list[Node]:
    kids = parent.children
    return list(kids.values()) if kids else []


def has_device_child(node: Node) -> bool:
    kids = node.children
    return bool(kids) and any(k.medium == DEVICE for k in kids.values())


def split(node: Node, k: int, stride: int) -> Node:
    """Cuts `node` after its first k pages (0 < k < len(node)): a new node takes them and is
    returned; `node` keeps the rest, its children, pins and slot, and is now the new node's only
    child. The new node is unpinned: no lease path ends inside a run."""
    cut = k * stride
    parent = node.parent
    head = Node(node.tokens[:cut], node.hashes[:k * HASH], node.pages[:k], parent, node.root,
                node.medium, node.used_at)
    head.rank, head.uses = node.rank, node.uses
    head.hits, head.in_remote = node.hits, node.in_remote
    head.superseded = node.superseded  # a use of either part is a use of the leaf
    node.tokens = node.tokens[cut:]
    node.hashes = node.hashes[k * HASH:]
    node.pages = node.pages[k:]
    if parent is not None:
        parent.children[head.tokens[:stride]] = head
    head.children = {node.tokens[:stride]: node}
    node.parent = head
    return head


def cut_tail(node: Node, k: int, stride: int) -> tuple[bytes, array]:
    """Removes the last k pages (0 < k < len(node)) of a childless run: (their hashes, pages)."""
    keep = size(node) - k
    hashes, pages = node.hashes[keep * HASH:], node.pages[keep:]
    node.tokens = node.tokens[:keep * stride]
    node.hashes = node.hashes[:keep * HASH]
    node.pages = node.pages[:keep]
    return hashes, pages


def walk(node: Node | Root, data: bytes, stride: int, limit: int,
         depth: int = 0) -> tuple[list[Node], int, int]:
    """The runs below `node` matching the full pages of `data` (u32-le tokens) from page
    `depth` on, up to page `limit`: (runs, depth reached, pages matched of the last run when
    only part of it matched, else 0). Each step is one dict lookup and one in-place C
    comparison of a whole run."""
    path: list[Node] = []
    while depth < limit:
        kids = node.children
        if kids is None:
            break
        start = depth * stride
        child = kids.get(data[start:start + stride])
        if child is None:
            break
        run = child.tokens
        size = len(run) // stride
        take = min(size, limit - depth)
        if take == size and data.startswith(run, start):
            matched = take
        else:
            matched = common_pages(run, memoryview(data)[start:start + take * stride], stride, take)
        path.append(child)
        depth += matched
        if matched < size:
            return path, depth, matched
        node = child
    return path, depth, 0


def nodes_below(root: Node | Root) -> Iterator[Node]:
    """Every node below `root` (not root itself), parents before children."""
    stack = children_of(root)
    while stack:
        node = stack.pop()
        yield node
        if node.children:
            stack.extend(node.children.values())


class PageView:
    """One cached page seen on its own (tests, snapshots, introspection; never the hot path).
    Equal views name the same page of the same run."""

    __slots__ = ("node", "index", "parent")

    def __init__(self, node: Node, index: int, parent):
        self.node, self.index, self.parent = node, index, parent

    @property
    def hash(self) -> bytes:
        return self.node.hashes[self.index * HASH:(self.index + 1) * HASH]

    @property
    def medium(self) -> int:
        return self.node.medium

    @property
    def page(self) -> int:
        pages = self.node.pages
        return -1 if pages is None else pages[self.index]

    @property
    def slot(self) -> int:
        return self.node.slot if self.index == size(self.node) - 1 else NO_SLOT

    @property
    def pins(self) -> int:
        """The leases whose path ends at this page (a run's pins belong to its last page)."""
        return self.node.pins if self.index == size(self.node) - 1 else 0

    def __eq__(self, other) -> bool:
        return (type(other) is PageView and other.node is self.node
                and other.index == self.index)

    def __hash__(self) -> int:
        return hash((id(self.node), self.index))

    def __repr__(self) -> str:
        return f"PageView({self.hash.hex()[:8]} page={self.page} medium={self.medium})"


def page_views(nodes: list[Node], first_parent) -> list[PageView]:
    """Views of every page of a chain of runs, each view's `parent` the view before it (the
    first one's `first_parent`); a removed run's views have parent None."""
    out: list[PageView] = []
    prev = first_parent
    for node in nodes:
        for i in range(size(node)):
            view = PageView(node, i, None if node.parent is None else prev)
            out.append(view)
            prev = view
    return out


def subtree(root: Node | Root) -> Iterator[PageView]:
    """Every page below `root`, parents before children."""
    for node in nodes_below(root):
        yield from page_views([node], node.parent)
