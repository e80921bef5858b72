"""One registered pool: its radix tree, free pages per medium, Mamba slots, leases and events.

The methods here apply operations that `core.CacheCore` has already validated; they never raise
for bad input. Every state change appends to `pending` (events, in order) and `copies` (the page
copies the worker must run, in order); the core turns them into one event batch per call.

Accounting invariant per medium: free + (in-tree or lease-held or dead-but-pinned) = total pages,
and a page is in exactly one of those places.

Longer than 400 lines: the tree, the allocator with its LRU, leases, the tier policy (host
demotion, L3 write policies) and the event emitter still share this module; the cache-core rewrite
(a path-compressed tree, issue "The cache core at SGLang's speed") splits them into one module
each, and moving them before that rewrite would only move code twice.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import operator
from dataclasses import dataclass, field

from cache_service import events
from cache_service.tree import (DEVICE, HOST, NO_SLOT, Node, Root, add_child, child, children_of,
                                common_pages, has_device_child, remove_child, subtree, walk)
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2, events_pb2
from prefixcache_client.hash import chain_hashes, namespace_seed, page_hash

MEDIA = (DEVICE, HOST)
_page_of = operator.attrgetter("page")
_hash_of = operator.attrgetter("hash")
REMOTE = common_pb2.MEDIUM_REMOTE
WRITE_THROUGH = pb.REMOTE_WRITE_POLICY_WRITE_THROUGH
WRITE_BACK = pb.REMOTE_WRITE_POLICY_WRITE_BACK
HOT = pb.REMOTE_WRITE_POLICY_HOT


@dataclass(slots=True)
class PoolConfig:
    pool_id: str
    epoch: int
    page_size: int
    device_pages: int
    host_pages: int
    mamba_slots: int
    model_id: str
    lease_ttl_s: float
    remote_write_policy: int = 0
    remote_min_hits: int = 1
    remote_lookup: bool = False

    def shape(self) -> tuple:
        return (self.page_size, self.device_pages, self.host_pages, self.mamba_slots,
                self.model_id, self.lease_ttl_s, self.remote_write_policy, self.remote_min_hits,
                self.remote_lookup)


@dataclass(slots=True, eq=False)
class Lease:
    """A running request. `nodes` are the tree nodes of pages[:len(nodes)], held by this lease
    (its deepest node is pinned); pages[len(nodes):] are held by the lease alone (computed or being computed, not
    published). `data` is the request's token sequence so far, as u32-le bytes."""
    lease_id: str
    root: Root
    data: bytearray
    pages: list[int]
    nodes: list[Node]
    ttl_s: float
    expires_at: float


@dataclass(slots=True)
class Counters:
    queried_tokens: int = 0
    hit_tokens: dict[int, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0, REMOTE: 0})
    evictions: dict[int, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0})
    remote_writes: int = 0
    mamba_evictions: int = 0
    lease_expiries: int = 0
    duplicate_pages: int = 0


class Pool:
    def __init__(self, cfg: PoolConfig, replay_events: int, clock, remote=None):
        """`remote` probes L3 (cache_service.l3.L3Client) when cfg.remote_lookup is set."""
        self.cfg = cfg
        self.remote = remote
        self.stride = 4 * cfg.page_size
        self.clock = clock
        # pop() hands out the lowest index first.
        self.free = {DEVICE: list(range(cfg.device_pages - 1, -1, -1)),
                     HOST: list(range(cfg.host_pages - 1, -1, -1))}
        self.free_slots = list(range(cfg.mamba_slots - 1, -1, -1))
        self.roots: dict[tuple[str, str], Root] = {}
        self.leases: dict[str, Lease] = {}
        self.cached = {DEVICE: 0, HOST: 0}
        # Insertion-ordered (not a set) so that LRU ties break the same way in every run.
        self.checkpointed: dict[Node, None] = {}
        self._heaps: dict[int, list] = {DEVICE: [], HOST: []}
        self._tie = itertools.count()
        self.counters = Counters()
        self.log = events.EventLog(cfg.pool_id, cfg.epoch, replay_events)
        self.load = common_pb2.LoadReport()
        self.closed = False
        self.pending: list[list] = []
        self.copies: list[common_pb2.CopyOp] = []
        self.expired: list[str] = []
        self._root_of: dict[Node, Root] = {}  # memo for events, valid during one call
        self._write_through: list[Node] = []  # published this step, written once checkpointed
        self.last_match: tuple[Root, bytes, list[Node]] | None = None  # within one step only
        self.pending.append(["cleared"])  # seq 0 of every epoch: subscribers start from empty

    # ---- namespaces ----------------------------------------------------------------------

    def root(self, adapter: str, salt: str, create: bool = True) -> Root | None:
        key = (adapter, salt)
        root = self.roots.get(key)
        if root is None and create:
            seed = namespace_seed(self.cfg.model_id, adapter, salt)
            root = self.roots[key] = Root(seed, self.cfg.model_id, adapter, salt)
        return root

    def evict_namespace(self, root: Root) -> tuple[int, int]:
        """Removes every page of the namespace now; pinned ones are freed when their leases end."""
        del self.roots[(root.adapter, root.salt)]
        root.dead = True
        # From now on a dead node's `pins` counts every lease whose path holds it (not only the
        # leases it is the deepest node of): each of them frees it on release when it is the last.
        held = collections.Counter(n for lease in self.leases.values() if lease.root is root
                                   for n in lease.nodes)
        removed = deferred = 0
        for node in list(subtree(root)):
            self._emit_removed(node.hash, node.medium)
            self.cached[node.medium] -= 1
            node.parent = None
            node.children = None
            node.pins = held.get(node, 0)
            if node.pins:
                deferred += 1
            else:
                self._free_node(node)
                removed += 1
        root.children = None
        return removed, deferred

    # ---- pins and eviction candidates ----------------------------------------------------
    #
    # A lease pins only the deepest node of its path: every ancestor has a device child on that
    # path, and eviction only takes nodes without one, so the whole path is safe. While a match
    # loads host pages back, its whole path is pinned for that moment (see `match`).

    def _pin(self, node: Node) -> None:
        node.pins += 1

    def _unpin(self, node: Node) -> None:
        node.pins -= 1
        if not node.pins:
            self._offer(node)

    def pinned_pages(self) -> dict[int, int]:
        """Cached pages held by running requests, per medium (their leases' paths)."""
        held = {n for lease in self.leases.values() if not lease.root.dead for n in lease.nodes}
        counts = {DEVICE: 0, HOST: 0}
        for node in held:
            counts[node.medium] += 1
        return counts

    def _is_candidate(self, node: Node) -> bool:
        """An unpinned node that eviction may take from its medium now: a device node with no
        device child (it is demoted or dropped), or a host node with no child (dropped)."""
        if node.parent is None or node.pins:
            return False
        if node.medium == DEVICE:
            return not has_device_child(node)
        return node.children is None

    def _offer(self, node: Node | Root) -> None:
        if type(node) is Node and self._is_candidate(node):
            heap = self._heaps[node.medium]
            heapq.heappush(heap, (node.last_used, next(self._tie), node))
            if len(heap) > 2 * self.cached[node.medium] + 1024:
                self._compact(node.medium)

    def _compact(self, medium: int) -> None:
        """Drops stale heap entries (a node is pushed each time it becomes a candidate again);
        every current candidate keeps exactly one entry."""
        live: dict[int, tuple] = {}
        # In heap order, keeping each node's first entry: ties keep breaking the same way, so the
        # pool stays deterministic (ids would reorder them from run to run).
        for entry in sorted(self._heaps[medium]):
            node = entry[2]
            if id(node) not in live and node.medium == medium and self._is_candidate(node):
                live[id(node)] = (node.last_used, entry[1], node)
        heap = list(live.values())
        heapq.heapify(heap)
        self._heaps[medium] = heap

    def _pop_lru(self, medium: int) -> Node | None:
        heap = self._heaps[medium]
        while heap:
            used, _, node = heapq.heappop(heap)
            if node.medium != medium or not self._is_candidate(node):
                continue  # stale entry; it is offered again when it becomes a candidate
            if node.last_used != used:
                heapq.heappush(heap, (node.last_used, next(self._tie), node))
                continue
            return node
        return None

    # ---- pages ----------------------------------------------------------------------------

    def take_device(self, n: int) -> list[int] | None:
        """n free device pages, evicting least-recently-used leaves if needed; None if impossible
        (pages evicted on the way stay free)."""
        free = self.free[DEVICE]
        while len(free) < n and self._evict_device():
            pass
        if len(free) < n:
            return None
        return [free.pop() for _ in range(n)]

    def _evict_device(self) -> bool:
        while (node := self._pop_lru(DEVICE)) is not None:
            if self.cfg.host_pages:
                host_page = self._take_host()
                if host_page is not None:
                    self._demote(node, host_page)
                    return True
            if node.children is None:
                self._drop(node)
                return True
            # A device page whose host children need it and no host room: keep it. It is offered
            # again when its children are dropped.
        return False

    def _take_host(self) -> int | None:
        if not self.free[HOST]:
            node = self._pop_lru(HOST)
            if node is None:
                return None
            self._drop(node)
        return self.free[HOST].pop()

    @staticmethod
    def _hand_up_last_use(node: Node) -> None:
        """A match touches only the deepest node of its path, not every ancestor. Eviction only
        compares nodes once they are candidates, and an ancestor becomes one only after every
        descendant left its medium; each hands its last use up on leaving, so the ancestor then
        carries the latest use of any path through it: the same LRU order as touching every
        node of every path, at O(1) per match."""
        parent = node.parent
        if type(parent) is Node and parent.last_used < node.last_used:
            parent.last_used = node.last_used

    def _free_node(self, node: Node) -> None:
        self.free[node.medium].append(node.page)
        node.page = -1
        if node.slot != NO_SLOT:
            self._free_slot(node)

    def _drop(self, node: Node) -> None:
        if self.cfg.remote_write_policy == WRITE_BACK:
            self._write_remote(node)  # listed before any copy that reuses its page
        self._hand_up_last_use(node)
        parent = node.parent
        remove_child(parent, node)
        self._emit_removed(node.hash, node.medium)
        self.cached[node.medium] -= 1
        self.counters.evictions[node.medium] += 1
        self._free_node(node)
        self._offer(parent)

    def _demote(self, node: Node, host_page: int) -> None:
        self.copies.append(common_pb2.CopyOp(src_medium=DEVICE, src_page=node.page, dst_medium=HOST,
                                             dst_page=host_page, page_hash=node.hash))
        self.free[DEVICE].append(node.page)
        self._hand_up_last_use(node)
        self._move(node, HOST, host_page)
        self.counters.evictions[DEVICE] += 1
        self._offer(node)
        self._offer(node.parent)

    def _write_remote(self, node: Node) -> None:
        """Asks the worker to write the page (and its checkpoint) to L3, once per page."""
        if node.in_remote:
            return
        node.in_remote = True
        self.counters.remote_writes += 1
        self.copies.append(common_pb2.CopyOp(src_medium=node.medium, src_page=node.page,
                                             dst_medium=REMOTE, page_hash=node.hash,
                                             mamba_slot=node.slot))

    def flush_write_through(self) -> None:
        """The L3 writes of this step's publishes (REMOTE_WRITE_POLICY_WRITE_THROUGH), emitted
        once the step's checkpoints are attached so that each write carries its page's slot."""
        for node in self._write_through:
            if node.parent is not None:
                self._write_remote(node)
        self._write_through.clear()

    def _promote(self, node: Node, device_page: int) -> None:
        """Load a (pinned) host page back onto the device (design.md lesson 12)."""
        self.copies.append(common_pb2.CopyOp(src_medium=HOST, src_page=node.page, dst_medium=DEVICE,
                                             dst_page=device_page, page_hash=node.hash))
        self.free[HOST].append(node.page)
        self._move(node, DEVICE, device_page)

    def _move(self, node: Node, medium: int, page: int) -> None:
        self._emit_removed(node.hash, node.medium)
        self.cached[node.medium] -= 1
        self.cached[medium] += 1
        node.medium = medium
        node.page = page
        parent = node.parent
        self._emit_stored(node, b"" if type(parent) is Root else parent.hash)

    # ---- Mamba checkpoint slots -----------------------------------------------------------

    def _take_slot(self) -> int | None:
        if not self.free_slots:
            victims = [n for n in self.checkpointed if not n.pins]
            if not victims:
                return None
            self._free_slot(min(victims, key=lambda n: n.last_used))
            self.counters.mamba_evictions += 1
        return self.free_slots.pop()

    def _free_slot(self, node: Node) -> None:
        self.free_slots.append(node.slot)
        node.slot = NO_SLOT
        self.checkpointed.pop(node, None)

    # ---- operations (validated by the core) -----------------------------------------------

    def match(self, request_id: str, lease_id: str, adapter: str, salt: str, data: bytes,
              ttl_s: float, is_resume: bool, skip_host_load: bool,
              omit_page_hashes: bool = False) -> pb.MatchResult:
        root = self.root(adapter, salt)
        # The last prompt token is always computed (its logits start decoding), so at most
        # (len - 1) // page_size pages can be reused.
        n_tokens = len(data) // 4
        limit = max(0, n_tokens - 1) // self.cfg.page_size
        known = None
        if self.last_match is not None and self.last_match[0] is root:
            # Matches of one step often share a prefix (a burst, a system prompt): start from the
            # pages the previous one already walked (pinned by its lease, so still in the tree).
            _, prev_data, prev_path = self.last_match
            known = prev_path[:common_pages(prev_data, data, self.stride, min(len(prev_path), limit))]
        found = walk(root, data, self.stride, limit, known)
        path = self._usable(found, skip_host_load)
        now = self.clock()
        host_hits = 0
        if path and path[-1].medium == HOST:  # host pages are a suffix: load them back (design.md lesson 12)
            loading = path
            for node in loading:
                self._pin(node)  # loading evicts: nothing on this path may go meanwhile
            for i, node in enumerate(loading):
                if node.medium != HOST:
                    continue
                pages = self.take_device(1)
                if pages is None:
                    path = loading[:i]
                    break
                self._promote(node, pages[0])
                host_hits += 1
            for node in loading:
                self._unpin(node)
            path = self._usable(path, skip_host_load)
            host_hits = min(host_hits, len(path))
        if path:
            self._pin(path[-1])
            # Only the deepest node is touched: see `_hand_up_last_use`.
            path[-1].last_used = now
        if self.cfg.remote_write_policy == HOT:
            for node in path:
                node.hits += 1
                if node.hits >= self.cfg.remote_min_hits:
                    self._write_remote(node)
        remote_hashes, remote_pages = self._probe_remote(root, path, data, n_tokens)
        page = self.cfg.page_size
        if not is_resume:
            self.counters.queried_tokens += n_tokens
            self.counters.hit_tokens[DEVICE] += (len(path) - host_hits) * page
            self.counters.hit_tokens[HOST] += host_hits * page
            self.counters.hit_tokens[REMOTE] += len(remote_pages) * page
        pages = list(map(_page_of, path))
        self.last_match = (root, data, path)
        self.leases[lease_id] = Lease(lease_id, root, bytearray(data), pages + remote_pages, path,
                                      ttl_s, now + ttl_s)
        hybrid = self.cfg.mamba_slots > 0
        return pb.MatchResult(
            request_id=request_id, lease_id=lease_id, device_pages=pages,
            cached_tokens=len(path) * page, device_hit_tokens=(len(path) - host_hits) * page,
            host_hit_tokens=host_hits * page,
            page_hashes=() if omit_page_hashes else list(map(_hash_of, path)),
            mamba_slot=path[-1].slot if hybrid and path else -1,
            unusable_pages=len(found) - len(path), remote_pages=remote_pages,
            remote_page_hashes=remote_hashes, remote_hit_tokens=len(remote_pages) * page)

    def _probe_remote(self, root: Root, path: list[Node], data: bytes,
                      n_tokens: int) -> tuple[list[bytes], list[int]]:
        """The L3 extension after `path`: page hashes found and device pages to load them into."""
        if self.remote is None or not self.cfg.remote_lookup:
            return [], []
        limit = max(0, n_tokens - 1) // self.cfg.page_size - len(path)
        if limit <= 0:
            return [], []
        start = len(path) * self.stride
        parent = path[-1].hash if path else root.hash
        hashes = chain_hashes(parent, data[start:start + limit * self.stride], self.cfg.page_size)
        found = self.remote.probe(self.cfg.model_id, hashes)
        pages = self.take_device(found) if found else None
        if pages is None:
            return [], []
        return hashes[:found], pages

    def _usable(self, path: list[Node], skip_host_load: bool) -> list[Node]:
        """The matched path cut where it cannot be resumed: at the first host page when host
        pages are not loaded back, and for hybrid pools at the deepest Mamba checkpoint."""
        if skip_host_load:
            for i, node in enumerate(path):
                if node.medium == HOST:
                    path = path[:i]
                    break
        if self.cfg.mamba_slots:
            depth = len(path)
            while depth and path[depth - 1].slot == NO_SLOT:
                depth -= 1
            path = path[:depth]
        return path

    def allocate(self, lease: Lease, n: int) -> pb.AllocateResult:
        pages = self.take_device(n)
        if pages is None:
            free, pinned = len(self.free[DEVICE]), self.pinned_pages()[DEVICE]
            return pb.AllocateResult(lease_id=lease.lease_id, ok=False, reason=(
                f"need {n} device pages: {free} free and none of the {self.cached[DEVICE] - pinned} "
                f"unpinned cached pages can be evicted; {pinned} are held by running requests"))
        lease.pages.extend(pages)
        return pb.AllocateResult(lease_id=lease.lease_id, ok=True, device_pages=pages)

    def publish(self, lease: Lease, append: bytes, computed_pages: int) -> pb.PublishResult:
        lease.data += append
        result = pb.PublishResult(lease_id=lease.lease_id)
        if lease.root.dead:
            return result  # the namespace was evicted: its pages die with the lease
        stride, now = self.stride, self.clock()
        deepest = lease.nodes[-1] if lease.nodes else None
        parent: Node | Root = deepest or lease.root
        for i in range(len(lease.nodes), computed_pages):
            key = bytes(lease.data[i * stride:(i + 1) * stride])
            node = child(parent, key)
            own = lease.pages[i]
            if node is None:
                node = Node(key, page_hash(parent.hash, key), parent, own, DEVICE, now)
                add_child(parent, node)
                self.cached[DEVICE] += 1
                self._emit_stored(node, b"" if type(parent) is Root else parent.hash)
                result.inserted_pages += 1
                if self.cfg.remote_write_policy == WRITE_THROUGH:
                    self._write_through.append(node)
            else:
                self.counters.duplicate_pages += 1
                if node.medium == DEVICE:
                    self.free[DEVICE].append(own)
                    lease.pages[i] = node.page
                    result.remaps.add(index=i, old_page=own, new_page=node.page)
                else:  # the host copy is redundant: adopt the lease's device page instead
                    self.free[HOST].append(node.page)
                    self._move(node, DEVICE, own)
            node.last_used = now
            lease.nodes.append(node)
            parent = node
        if parent is not deepest and type(parent) is Node:  # the pin moves to the new deepest
            self._pin(parent)
            if deepest is not None:
                self._unpin(deepest)
        return result

    def checkpoint(self, lease: Lease, page_index: int, detach: bool) -> pb.CheckpointResult:
        result = pb.CheckpointResult(lease_id=lease.lease_id, page_index=page_index, slot=-1)
        # Pages published after the namespace was evicted never entered the tree (design.md lesson 5).
        if page_index >= len(lease.nodes) or lease.nodes[page_index].parent is None:
            result.reason = "the page's namespace was evicted"
            return result
        node = lease.nodes[page_index]
        if detach:
            result.ok = True
            if node.slot != NO_SLOT:
                result.slot = node.slot
                self._free_slot(node)
            return result
        if node.slot != NO_SLOT:
            result.ok, result.slot, result.already_present = True, node.slot, True
            return result
        slot = self._take_slot()
        if slot is None:
            result.reason = f"all {self.cfg.mamba_slots} Mamba slots hold checkpoints of pinned pages"
            return result
        node.slot = slot
        self.checkpointed[node] = None
        result.ok, result.slot = True, slot
        return result

    def release(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        if lease.root.dead:  # deferred namespace eviction (design.md lesson 5): free what no lease holds
            for node in lease.nodes:
                node.pins -= 1
                if not node.pins:
                    self._free_node(node)
        elif lease.nodes:
            self._unpin(lease.nodes[-1])
        self.free[DEVICE].extend(lease.pages[len(lease.nodes):])

    def renew(self, lease: Lease) -> None:
        lease.expires_at = self.clock() + lease.ttl_s

    def expire(self) -> int:
        now = self.clock()
        overdue = [lease for lease in self.leases.values() if lease.expires_at < now]
        for lease in overdue:
            self.release(lease)
            self.expired.append(lease.lease_id)
        self.counters.lease_expiries += len(overdue)
        return len(overdue)

    # ---- events -------------------------------------------------------------------------

    def _emit_stored(self, node: Node, parent_hash: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        # Extend the previous BlockStored when this page continues its chain on the same medium.
        if (last and last[0] == "stored" and last[1] == node.medium and last[3][-1] == parent_hash
                and parent_hash):
            last[3].append(node.hash)
            last[4] += node.key
            return
        self.pending.append(["stored", node.medium, parent_hash, [node.hash], bytearray(node.key),
                             self._root(node).adapter])

    def _root(self, node: Node) -> Root:
        """The namespace root above `node`, memoised for the current call (demotions emit one
        event per page, and each would otherwise walk to the root)."""
        chain, up = [], node.parent
        while type(up) is Node:
            known = self._root_of.get(up)
            if known is not None:
                up = known
                break
            chain.append(up)
            up = up.parent
        for n in chain:
            self._root_of[n] = up
        return up

    def _emit_removed(self, page_hash_: bytes, medium: int) -> None:
        last = self.pending[-1] if self.pending else None
        if last and last[0] == "removed" and last[1] == medium:
            last[2].append(page_hash_)
        else:
            self.pending.append(["removed", medium, [page_hash_]])

    def take_events(self) -> list[events_pb2.KvEvent]:
        out = [self._to_event(p) for p in self.pending]
        self.pending.clear()
        self._root_of.clear()
        return out

    def _to_event(self, p: list) -> events_pb2.KvEvent:
        if p[0] == "stored":
            return events.stored(p[3], p[2], bytes(p[4]), self.cfg.page_size, self.cfg.model_id,
                                 p[5], p[1])
        if p[0] == "removed":
            return events.removed(p[2], p[1])
        return events.cleared()

    def snapshot_events(self) -> list[events_pb2.KvEvent]:
        """Events that rebuild the current page set from empty: AllBlocksCleared, then every
        page of every live namespace, parents first."""
        saved, self.pending = self.pending, [["cleared"]]
        try:
            for root in self.roots.values():
                stack = children_of(root)
                while stack:
                    node = stack.pop()
                    self._emit_stored(node, b"" if type(node.parent) is Root else node.parent.hash)
                    stack.extend(children_of(node))
            return self.take_events()
        finally:
            self.pending = saved
