"""One registered pool: the operations of a Step applied to its tree (design.md §4).

The methods here apply operations that the Step operations (step/) have already validated; they
never raise for bad input, and they return typed results (results.py) that the Step operations
turn into the RPC's messages. What they change is spread over single-purpose parts: the tree of
runs (tree.py), free pages, the LRU and Mamba slots (allocator.py), leases (leases.py), the
placement policy (placement.py: eviction, demotion, load-back, L3 writes) and the event emitter
(emitter.py). Every state change appends to the emitter (event records, in order) and to
`copies` (the page copies the worker must run, in order); the core turns the records into one
batch per call.
"""
from __future__ import annotations

import collections
from array import array

from cache_service.allocator import MEDIA, Pages, Slots, emit_checkpoint
from cache_service.chain_hash import chain_function
from cache_service.emitter import Emitter
from cache_service.events import CLEARED, EventLog, to_event
from cache_service.eviction import make_policy
from cache_service.l3_refill import Refill
from cache_service.leases import Lease, locate, path_to, pinned_pages
from cache_service.placement import REMOTE, Placement
from cache_service.pool_config import Counters, PoolConfig
from cache_service.retention import Retention, RetentionConfig
from cache_service.results import (Allocated, Checkpointed, Matched, NamespaceEvicted,
                                   Published)
from cache_service.tree import (DEVICE, HOST, NO_SLOT, PAGE_CODE, Node, Root, add_child,
                                event_parent, nodes_below, size, walk)
from prefixcache.v1 import common_pb2, events_pb2
from prefixcache_client.hash import namespace_seed

__all__ = ["MEDIA", "REMOTE", "Allocated", "Checkpointed", "Counters", "Lease", "Matched", "Pool",
           "PoolConfig", "Published"]


class Pool:
    def __init__(self, cfg: PoolConfig, replay_events: int, clock, remote=None,
                 eviction: str = "lru", retention: RetentionConfig | None = None):
        """`remote` probes L3 (pagestore.L3Client) when cfg.remote_lookup is set; `eviction`
        names the policy that ranks runs (cache_service/eviction.py); `retention` bounds the
        protection of retained prefixes (cache_service/retention.py; default: none honoured)."""
        self.cfg = cfg
        self.eviction = make_policy(eviction, cfg.device_pages + cfg.host_pages)
        self.stride = 4 * cfg.page_size
        self.clock = clock
        self.roots: dict[tuple[str, str], Root] = {}
        self.leases: dict[str, Lease] = {}
        self.pages = Pages(cfg.device_pages, cfg.host_pages, self.eviction)
        self.free, self.cached = self.pages.free, self.pages.cached
        self.events = Emitter()
        self.slots = Slots(cfg.mamba_slots, self.events)
        self.checkpointed = self.slots.checkpointed
        self.counters = Counters()
        self.chain = chain_function()
        self.placement = Placement(cfg, self.pages, self.slots, self.events, self.counters, remote,
                           self.chain)
        self.copies = self.placement.copies
        self.refill = Refill(self.placement, self.roots, remote, clock)
        self.log = EventLog(cfg.pool_id, cfg.epoch, replay_events, cfg.page_size, cfg.model_id)
        self.load = common_pb2.LoadReport()
        self.closed = False
        self.expired: list[str] = []
        self.retention = Retention(retention or RetentionConfig(), cfg.device_pages, self._pin,
                                   self._unpin)

    # ---- namespaces ----------------------------------------------------------------------

    def root(self, adapter: str, salt: str, create: bool = True) -> Root | None:
        key = (adapter, salt)
        root = self.roots.get(key)
        if root is None and create:
            seed = namespace_seed(self.cfg.model_id, adapter, salt)
            root = self.roots[key] = Root(seed, self.cfg.model_id, adapter, salt)
        return root

    def evict_namespace(self, root: Root) -> NamespaceEvicted:
        """Removes every page of the namespace now; pinned ones are freed when their leases end."""
        del self.roots[(root.adapter, root.salt)]
        root.dead = True
        self.retention.forget_namespace(root)
        # From now on a dead run's `pins` counts every lease whose path holds it (not only the
        # leases it is the deepest run of): each of them frees it on release when it is the last.
        held: collections.Counter = collections.Counter()
        for lease in self.leases.values():
            if lease.root is root:
                lease.dead_path = path_to(lease.deepest)
                held.update(lease.dead_path)
        removed = deferred = 0
        for node in list(nodes_below(root)):
            n = size(node)
            self.events.removed(node.medium, node.hashes)
            # Its checkpoint goes with its pages, even while a lease keeps the slot (found by
            # test_vllm_events_properties: the same prefix served again was stored twice).
            self.slots.forget(node)
            self.cached[node.medium] -= n
            node.parent = None
            node.children = None
            node.pins = held.get(node, 0)
            if node.pins:
                deferred += n
            else:
                self._free_dead(node)
                removed += n
        root.children = None
        return NamespaceEvicted(removed, deferred)

    def _free_dead(self, node: Node) -> None:
        self.free[node.medium].extend(node.pages)
        node.pages = None
        self.slots.release(node)

    @staticmethod
    def _pin(node: Node) -> None:
        node.pins += 1

    def _unpin(self, node: Node) -> None:
        node.pins -= 1
        if not node.pins:
            self.pages.offer(node)

    def pinned_pages(self) -> dict[int, int]:
        """Cached pages held by running requests (their leases' paths) and by retained
        prefixes, per medium."""
        return pinned_pages(self.leases.values(), self.retention.nodes())

    # ---- operations (validated by the core) -----------------------------------------------

    def match(self, request_id: str, lease_id: str, adapter: str, salt: str, data: bytes,
              ttl_s: float, is_resume: bool, skip_host_load: bool,
              omit_page_hashes: bool = False, retain_s: float = 0.0) -> Matched:
        self.retention.expire(self.clock())
        root = self.root(adapter, salt)
        page = self.cfg.page_size
        hybrid = self.cfg.mamba_slots > 0
        # The last prompt token is always computed (its logits start decoding), so at most
        # (len - 1) // page_size pages can be reused.
        n_tokens = len(data) >> 2
        path, found, part = walk(root, data, self.stride, max(0, n_tokens - 1) // page)
        if part:  # the match ends inside a run: cut it there, unless that part is unusable
            if hybrid or (skip_host_load and path[-1].medium == HOST):
                path.pop()
            else:
                path[-1] = self.placement.split(path[-1], part)
        path = self._usable(path, skip_host_load)
        host_hits = 0
        if path and path[-1].medium == HOST:  # a host suffix: load it back (design.md lesson 12)
            path, host_hits = self._load_back(path)
        depth = 0
        for node in path:
            depth += size(node)
        now = self.clock()
        deepest = path[-1] if path else None
        if deepest is not None:
            deepest.pins += 1
            self.eviction.use(deepest, now)  # only the deepest run: see allocator.py
        self.placement.matched(path)
        remote = self.placement.probe_remote(root, path, depth, data, n_tokens)
        if not is_resume:
            c = self.counters
            c.queried_tokens += n_tokens
            c.hit_tokens[DEVICE] += (depth - host_hits) * page
            c.hit_tokens[HOST] += host_hits * page
            c.hit_tokens[REMOTE] += len(remote.pages) * page
        pages = array(PAGE_CODE)
        for node in path:
            pages += node.pages
        self.leases[lease_id] = Lease(lease_id, root, data, pages + remote.pages,
                                      deepest, depth, ttl_s, now + ttl_s, retain_s=retain_s)
        return Matched(lease_id, pages,
                       b"" if omit_page_hashes else b"".join([n.hashes for n in path]), host_hits,
                       found - depth, deepest.slot if hybrid and path else NO_SLOT,
                       remote.pages, remote.page_hashes)

    def _usable(self, path: list[Node], skip_host_load: bool) -> list[Node]:
        """The matched runs cut where they cannot be resumed: at the first host run when host
        pages are not loaded back, and for hybrid pools after the deepest Mamba checkpoint."""
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

    def _load_back(self, path: list[Node]) -> tuple[list[Node], int]:
        """Loads the host runs of a matched path onto the device, as far as device pages can
        be found: (the usable path, pages loaded that it holds)."""
        for node in path:
            node.pins += 1  # loading evicts: nothing on this path may go meanwhile
        loading, loaded = path, 0
        for i, node in enumerate(loading):
            if node.medium != HOST:
                continue
            pages = self.placement.take_device(size(node))
            if pages is None:  # everything evictable is gone: load what fits
                fits = len(self.free[DEVICE])
                path = loading[:i]
                if fits:
                    head = self.placement.split(node, fits)
                    self.placement.promote(head, self.pages.take(DEVICE, fits))
                    path.append(head)
                    loaded += fits
                break
            self.placement.promote(node, pages)
            loaded += len(pages)
        for node in loading:
            self._unpin(node)
        usable = self._usable(path, False)
        cut = sum(size(n) for n in path[len(usable):])  # loaded pages are the path's tail
        return usable, max(0, loaded - cut)

    def allocate(self, lease: Lease, n: int) -> Allocated:
        pages = self.placement.take_device(n)
        if pages is None:
            free, pinned = len(self.free[DEVICE]), self.pinned_pages()[DEVICE]
            return Allocated(lease.lease_id, False, reason=(
                f"need {n} device pages: {free} free and none of the {self.cached[DEVICE] - pinned} "
                f"unpinned cached pages can be evicted; {pinned} are held by running requests or "
                f"retained prefixes"))
        lease.page_table += pages
        return Allocated(lease.lease_id, True, pages)

    def publish(self, lease: Lease, append: bytes, computed_pages: int) -> Published:
        if append:
            if type(lease.data) is bytes:
                lease.data = bytearray(lease.data)
            lease.data += append
        result = Published(lease.lease_id)
        if lease.root.dead or computed_pages <= lease.published:
            return result  # nothing new; or the namespace was evicted: its pages die with the lease
        now = self.clock()
        old = lease.deepest
        parent: Node | Root = lease.root if old is None else old
        depth = lease.published
        if parent.children:  # pages a sibling published already
            data = lease.data if type(lease.data) is bytes else bytes(lease.data)
            path, end, part = walk(parent, data, self.stride, computed_pages, depth)
            if part:
                path[-1] = self.placement.split(path[-1], part)
            for node in path:
                self._duplicates(lease, node, depth, result)
                self.eviction.refresh(node, now)
                depth += size(node)
            parent = path[-1] if path else parent
        if depth < computed_pages:
            parent = self._insert(lease, parent, depth, computed_pages, now)
            result.inserted_pages = computed_pages - depth
        if parent is not old:  # the pin moves to the new deepest run
            parent.pins += 1
            if old is not None:
                self._unpin(old)
            lease.deepest = parent
        lease.published = computed_pages
        return result

    def _duplicates(self, lease: Lease, node: Node, depth: int, result: Published) -> None:
        """The lease computed pages the tree holds already (a sibling published them first)."""
        n = size(node)
        self.counters.duplicate_pages += n
        own = lease.page_table[depth:depth + n]
        if node.medium == DEVICE:  # the lease's copies go back; it uses the tree's pages
            self.free[DEVICE].extend(own)
            lease.page_table[depth:depth + n] = node.pages
            result.remaps += zip(range(depth, depth + n), own, node.pages)
        else:  # the host copy is redundant: the run adopts the lease's device pages instead
            self.placement.adopt(node, own)

    def _insert(self, lease: Lease, parent: Node | Root, depth: int, end: int, now: float) -> Node:
        """Pages [depth, end) of the lease enter the tree below `parent`, hashed now
        (design.md lesson 3)."""
        stride = self.stride
        tokens = bytes(memoryview(lease.data)[depth * stride:end * stride])
        chained = parent.hash if type(parent) is Root else parent.hashes[-16:]
        hashes = self.chain(chained, tokens, stride)
        # A new run, never an extension of the parent's: runs are immutable until split, so
        # the event log shares their bytes instead of copying them.
        node = Node(tokens, hashes, lease.page_table[depth:end], parent, lease.root, DEVICE, now)
        self.eviction.use(node, now)
        add_child(parent, node, stride)
        dead = self.eviction.inserted(node)
        if dead is not None:
            self.pages.requeue(dead)
        self.placement.published(node)
        self.cached[DEVICE] += end - depth
        self.events.stored(DEVICE, b"" if type(parent) is Root else chained, hashes, tokens,
                           lease.root.adapter, lease.root.hash)
        return node

    def checkpoint(self, lease: Lease, page_index: int, detach: bool) -> Checkpointed:
        result = Checkpointed(lease.lease_id, page_index)
        # Pages published after the namespace was evicted never entered the tree
        # (design.md lesson 5).
        if lease.root.dead or page_index >= lease.published:
            result.reason = "the page's namespace was evicted"
            return result
        node, pos = locate(lease, page_index)
        last = pos == size(node) - 1
        if detach:
            result.ok = True
            if last and node.slot != NO_SLOT:
                result.slot = node.slot
                self.slots.release(node)
            return result
        if last and node.slot != NO_SLOT:
            result.ok, result.slot, result.already_present = True, node.slot, True
            return result
        slot = self.slots.take()
        if slot is None:
            result.reason = f"all {self.cfg.mamba_slots} Mamba slots hold checkpoints of pinned pages"
            return result
        if not last:  # a slot is the state after a run's last page
            node = self.placement.split(node, pos + 1)
        self.slots.attach(node, slot)
        result.ok, result.slot = True, slot
        return result

    def flush_write_through(self) -> None:
        """This step's write-through, then the writes listed again (l3_refill) after it."""
        self.placement.flush_write_through()
        self.refill.step()

    def remote_writes_failed(self, hashes: bytes) -> None:
        """The worker reported L3 writes it could not do (StepRequest.failed_remote_writes)."""
        self.refill.report_failed(hashes)

    def release(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        if lease.dead_path is not None:  # deferred eviction (design.md lesson 5)
            for node in lease.dead_path:
                node.pins -= 1
                if not node.pins:
                    self._free_dead(node)
        elif lease.deepest is not None:
            if lease.retain_s > 0:  # pinned by its protection before its lease lets go
                self._retain(path_to(lease.deepest), lease.retain_s)
            self._unpin(lease.deepest)
        if len(lease.page_table) > lease.published:
            self.free[DEVICE].extend(lease.page_table[lease.published:])

    def _retain(self, path: list[Node], retain_s: float) -> None:
        """Protects a retained request's path on device and, in a pool with an L3 write
        policy, writes it to L3 now (kept there for the worker's --l3-ttl-s, 24 h by default)."""
        if self.retention.protect(path, retain_s, self.clock()) and self.cfg.remote_write_policy:
            for node in path:
                self.placement.write_remote(node)

    def renew(self, lease: Lease) -> None:
        lease.expires_at = self.clock() + lease.ttl_s

    def expire(self) -> int:
        now = self.clock()
        self.retention.expire(now)
        overdue = [lease for lease in self.leases.values() if lease.expires_at < now]
        for lease in overdue:
            self.release(lease)
            self.expired.append(lease.lease_id)
        self.counters.lease_expiries += len(overdue)
        return len(overdue)

    # ---- events -------------------------------------------------------------------------

    def take_events(self) -> list[list]:
        """The event records of this call, for `EventLog.append`."""
        return self.events.take()

    def snapshot_records(self) -> list[list]:
        """Records that rebuild the current page set from empty: AllBlocksCleared, then every
        page of every live namespace, parents first, each checkpointed page after its run."""
        emit = Emitter()
        emit.pending = [[CLEARED]]
        hybrid = self.cfg.mamba_slots > 0
        for root in self.roots.values():
            for node in nodes_below(root):
                emit.stored(node.medium, event_parent(node), node.hashes, node.tokens,
                            root.adapter, root.hash)
                if hybrid and node.slot != NO_SLOT:
                    emit_checkpoint(emit, node)
        return emit.take()

    def snapshot_events(self, packed: bool = False) -> list[events_pb2.KvEvent]:
        """`snapshot_records` as the gRPC stream's events (hashes packed or not)."""
        events = (to_event(r, self.cfg.page_size, self.cfg.model_id, packed)
                  for r in self.snapshot_records())
        return [e for e in events if e is not None]
