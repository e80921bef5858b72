"""The engine: continuous batching with chunked prefill over a paged KV cache, driven by the cache
service through one batched Step call per engine step.

One step:
1. Build the cache ops: for requests retiring (finished, aborted, preempted) a final publish, their
   pending Mamba checkpoints and a release; for running requests the publish of every newly
   computed full page (lesson 1: during prefill, not at the end) and their checkpoints; page
   allocations for this step's tokens; matches for admitted waiting requests; lease renewals.
2. One `cache.step(...)` (the in-process CacheCore or the gRPC CacheClient: same messages).
3. Re-point remapped pages, store checkpoints into the slots it gave, run the page copies it
   returns (demotions, load-backs, L3 writes: compute_service.tiers), load the L3 extensions of
   this step's matches (one batched load for all of them), start matched requests (their cached prefix, L3
   pages included, is skipped whole, lesson 9: `computed` starts at the cached length), preempt
   requests it could not give pages.
4. One forward over every scheduled request: each computes `min(remaining, budget)` tokens, where
   remaining = tokens not yet in its KV. A request whose KV catches up with its tokens samples its
   next token (decode is the case remaining == 1). The token budget counts computed tokens only.

Tiers: with `host_pages` the cache service demotes evicted pages to a host pool and loads host
hits back through the step's copies. With an L3 client (`l3`), the pool is registered with the
configured write policy and lookup; L3 writes are gathered in the step and finished in the
background; an L3 page that is missing, invalid, or behind a Redis failure is computed instead
(requests never fail because of Redis).

Same-step deduplication: a waiting request that shares whole pages with a running (or just
admitted) request that has not published them yet waits for those publishes instead of computing
the same pages; it then matches them as a cache hit (`shared_tokens_in_flight`).

Twins (N samples of one prompt, as RL rollouts send them): when a request's prompt completes, every
waiting request with the same prompt in the same namespace that has sampled nothing yet samples
its first token from the same logits row, with its own sampling parameters and generator, in the
same step. It is then admitted like any sibling (it matches the published pages and computes the
prompt's partial last page and that token), so its first token no longer waits for a step of its
own (`first_token_from_twin`).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cache_service.errors import CacheError, ErrorCode
from cache_service.l3 import L3Client
from cache_service.tree import common_pages
from compute_service.engine.request import FinishReason, Output, Request, RequestStats, Status
from compute_service.engine.sampling import SamplingParams, sample
from compute_service.model import (CausalLM, ForwardBatch, ForwardMode, Tokenizer,
                                   allocate_kv_caches, allocate_mamba_states)
from compute_service.tiers import (WRITE_POLICIES, PageData, PageLayout, RemoteTier,
                                   RemoteTierConfig, allocate_host_pool)
from compute_service.lora import AdapterNotFoundError, AdapterRegistry, NoFreeSlotError
from compute_service.tiers.mover import TierMover
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2

log = logging.getLogger("compute_service.engine")


@dataclass(slots=True)
class EngineConfig:
    pool_id: str = "worker-0"
    model_id: str = "model"
    page_size: int = 16
    device_pages: int = 1024
    host_pages: int = 0
    checkpoint_slots: int = 64  # Mamba checkpoint slots (hybrid and Mamba models only)
    # Mamba checkpoints are taken every this many pages of prefill (a hybrid prefix can only be
    # resumed where one exists), plus at every chunk end and at the prompt's last whole page.
    checkpoint_every_pages: int = 1
    max_running: int = 16
    token_budget: int = 512  # tokens computed per step, over all requests
    # Twins take their first token from the logits of the request that completes their prompt
    # (see the module docstring); False makes them wait for a step of their own.
    twin_first_tokens: bool = True
    max_context: int = 8192
    lease_ttl_s: float = 0.0  # 0 = the cache service's default; must exceed the slowest step
    # L3 (Redis) tier: a cache_service.l3.L3Client, or None for no L3. The write policy is one of
    # WRITE_POLICIES (none, write-through, write-back, hot); `l3_lookup` makes the cache service
    # probe L3 at every match (it needs its own L3 client for that).
    l3: L3Client | None = None
    l3_write_policy: str = "none"
    l3_min_hits: int = 1  # hot policy: write a page once it was hit this many times
    l3_lookup: bool = False
    l3_write_queue_bytes: int = 256 << 20  # gathered pages waiting for Redis; beyond: dropped
    l3_batch_pages: int = 32  # pages per Redis round trip, for writes and for loads
    # LoRA: adapters loaded at once (their weights are reserved up front; 0 = no adapters), the
    # largest rank, and how many distinct adapters one step may run (requests beyond wait).
    max_loaded_adapters: int = 4
    max_lora_rank: int = 16
    max_loras: int = 4


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    forward_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # device, host and L3 hits
    remote_loaded_tokens: int = 0  # prompt tokens loaded from L3 instead of computed
    shared_in_flight_tokens: int = 0
    twin_first_tokens: int = 0  # first tokens sampled from a twin's logits (see the docstring)
    preemptions: int = 0
    recoveries: int = 0  # times the cache service lost this pool and the engine re-registered


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, cache, cfg: EngineConfig | None = None):
        """`cache` is a CacheCore (embedded) or a CacheClient (remote): both take the same
        RegisterPoolRequest / StepRequest messages."""
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.cfg = cfg = cfg or EngineConfig()
        mc = model.config
        self.vocab_size = mc.vocab_size
        self.eos = tuple(tokenizer.eos_token_ids)
        self.mamba = bool(mc.mamba_layer_ids)
        self.ckpt_slots = cfg.checkpoint_slots if self.mamba else 0
        if cfg.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1 (adapter requests would wait forever), "
                             f"got {cfg.max_loras}")
        if cfg.l3_write_policy not in WRITE_POLICIES:
            raise ValueError(f"l3_write_policy: {cfg.l3_write_policy!r} is not one of "
                             f"{', '.join(WRITE_POLICIES)}")
        if cfg.l3 is None and (cfg.l3_write_policy != "none" or cfg.l3_lookup):
            raise ValueError("l3: an L3 write policy or lookup needs an L3 client (--redis-url)")
        self.kv = allocate_kv_caches(mc, cfg.device_pages, cfg.page_size, model.dtype, model.device)
        self.host_kv = allocate_host_pool(self.kv, cfg.host_pages, pin=model.device.type == "cuda")
        # Running slots first, then the cache service's checkpoint slots.
        self.states = (allocate_mamba_states(mc, cfg.max_running + self.ckpt_slots, model.dtype,
                                             model.device) if self.mamba else [])
        # A min-heap: the lowest free slot first, so that a steady batch's slots tend to form one
        # run, which the CPU Mamba update serves in place (kernels.mamba_torch).
        self.free_slots = list(range(cfg.max_running))
        layout = PageLayout.of_model(mc, cfg.page_size, model.dtype)
        self.l3 = (RemoteTier(cfg.l3, cfg.model_id, layout, RemoteTierConfig(
            cfg.l3_write_queue_bytes, cfg.l3_batch_pages)) if cfg.l3 is not None else None)
        self.tiers = TierMover(self.kv, self.host_kv, self.states, cfg.max_running, layout, self.l3)
        self.adapters = (AdapterRegistry(model, max_loaded=cfg.max_loaded_adapters,
                                         max_rank=cfg.max_lora_rank)
                         if cfg.max_loaded_adapters else None)
        self._register()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.retiring: list[Request] = []
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._live: dict[str, Request] = {}  # every unfinished request, by id (under _lock)
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._pool_unknown = False  # set when a step failed in a way that may have lost state

    def _register(self) -> None:
        """Registers the pool under a new epoch (at start, and when the cache service lost it)."""
        cfg = self.cfg
        self.epoch = time.time_ns()
        self.cache.register_pool(pb.RegisterPoolRequest(
            pool_id=cfg.pool_id, epoch=self.epoch, page_size=cfg.page_size,
            device_pages=cfg.device_pages, host_pages=cfg.host_pages,
            mamba_slots=self.ckpt_slots, model_id=cfg.model_id, lease_ttl_s=cfg.lease_ttl_s,
            remote_write_policy=WRITE_POLICIES[cfg.l3_write_policy],
            remote_min_hits=cfg.l3_min_hits, remote_lookup=cfg.l3_lookup))

    @property
    def context_limit(self) -> int:
        """Prompt + output tokens one request may reach on this worker."""
        return min(self.cfg.max_context, self.cfg.device_pages * self.cfg.page_size)

    # ---- adapters -----------------------------------------------------------------------

    def adapter_names(self) -> list[str]:
        return self.adapters.names() if self.adapters is not None else []

    def load_adapter(self, name: str, path: str):
        """Loads a PEFT adapter; raises compute_service.lora errors (config, exists, no slot)."""
        if self.adapters is None:
            raise NoFreeSlotError("adapters: this worker runs with max_loaded_adapters=0")
        return self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> tuple[int, int]:
        """Unloads an adapter and evicts its cache namespace for every tenant (lesson 5: pages of
        running requests are freed when they end, and their weights stay until then).
        Returns (pages removed now, pages deferred)."""
        if self.adapters is None or name not in self.adapters.names():
            raise AdapterNotFoundError(f"name: adapter '{name}' is not loaded")
        self.adapters.unload(name)
        try:
            resp = self.cache.evict_namespace(pb.EvictNamespaceRequest(
                pool_id=self.cfg.pool_id, namespace=common_pb2.Namespace(adapter=name),
                all_salts=True))
        except CacheError as err:
            if err.code != ErrorCode.NOT_FOUND:
                raise
            return 0, 0  # nothing of it was cached
        return resp.removed_pages, resp.deferred_pages

    # ---- requests -----------------------------------------------------------------------

    def submit(self, prompt: list[int], sampling: SamplingParams, sink: Callable[[Output], None],
               request_id: str = "", adapter: str = "", salt: str = "") -> Request:
        """Queues a request; raises ValueError naming the bad field."""
        if not prompt:
            raise ValueError("prompt: must not be empty")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt.token_ids: {bad} is outside the vocabulary [0, {self.vocab_size})")
        sampling.validate(self.vocab_size)
        if adapter and adapter not in self.adapter_names():
            raise LookupError(f"adapter: '{adapter}' is not loaded on this worker")
        if len(salt.encode()) > 256:
            raise ValueError("salt: must be at most 256 UTF-8 bytes")
        limit = self.context_limit
        if len(prompt) + sampling.max_tokens > limit:
            raise ValueError(f"prompt: {len(prompt)} tokens + max_tokens {sampling.max_tokens} exceed "
                             f"this worker's context of {limit} tokens")
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt), sampling, sink,
                      adapter=adapter, salt=salt)
        if sampling.seed is not None:
            req.generator = torch.Generator(device=self.model.device).manual_seed(sampling.seed)
        req.stats = RequestStats(req.id, self.cfg.pool_id, len(prompt))
        with self._lock:
            if req.id in self._live:
                raise ValueError(f"request_id: '{req.id}' is already running on this worker")
            self._live[req.id] = req
            self._inbox.append(req)
            self._wakeup.notify()
        return req

    def abort(self, request_id: str) -> bool:
        """Thread-safe: marks the request; the engine thread ends it at its next step."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._aborts.add(request_id)
            self._wakeup.notify()
            return True

    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or self.running or self.retiring)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> None:
        cfg, P = self.cfg, self.cfg.page_size
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        for r in list(self.waiting):
            if r.id in aborts:
                self.waiting.remove(r)
                self._finish(r, FinishReason.ABORT)
        for r in list(self.running):
            if r.id in aborts:
                self._finish(r, FinishReason.ABORT)
                self._retire(r)
        for r in self.retiring:  # preempted, waiting for its release: not requeued after it
            if r.id in aborts and r.status is Status.WAITING:
                self._finish(r, FinishReason.ABORT)

        req = pb.StepRequest(pool_id=cfg.pool_id, epoch=self.epoch)
        by_lease: dict[str, Request] = {}
        retiring, self.retiring = self.retiring, []
        # What building the ops changes, restored if the cache call fails (nothing happened).
        saved = [(r, r.lease_tokens, r.published) for r in retiring + self.running]
        for r in retiring + self.running:
            by_lease[r.lease] = r
            self._publish_and_checkpoint_ops(req, r)
        req.releases.extend(pb.ReleaseOp(lease_id=r.lease) for r in retiring)

        scheduled: list[tuple[Request, int]] = []
        budget = cfg.token_budget
        # Decoding requests first (one token each), then prefill chunks, oldest first.
        for r in sorted(self.running, key=lambda r: (r.num_tokens - r.computed > 1, r.arrival)):
            n = min(r.num_tokens - r.computed, budget)
            if n <= 0:
                continue
            budget -= n
            need = -(-(r.computed + n) // P) - len(r.pages)
            if need > 0:
                req.allocations.add(lease_id=r.lease, num_pages=need)
            scheduled.append((r, n))

        admitted: list[Request] = []
        room = min(cfg.max_running - len(self.running), len(self.free_slots))
        adapters = {r.adapter for r in self.running if r.adapter}
        for r in list(self.waiting):
            if len(admitted) >= room:
                break
            if r.adapter and r.adapter not in adapters and len(adapters) >= cfg.max_loras:
                continue  # the step already runs max_loras adapters: wait, holding nothing
            if r.adapter and r.adapter not in self.adapter_names():
                self.waiting.remove(r)  # unloaded while it waited
                self._finish(r, FinishReason.ABORT)
                continue
            if self._waits_for_sibling(r, admitted):
                r.waited_on_sibling = True
                continue
            req.matches.add(request_id=r.id, packed_token_ids=r.token_bytes(), is_resume=r.resumed,
                            omit_page_hashes=True,
                            namespace=common_pb2.Namespace(adapter=r.adapter, salt=r.salt))
            admitted.append(r)
            if r.adapter:
                adapters.add(r.adapter)
        touched = {op.lease_id for op in req.publishes} | {op.lease_id for op in req.allocations}
        req.renew_lease_ids.extend(r.lease for r in self.running if r.lease not in touched)
        req.load.CopyFrom(common_pb2.LoadReport(
            waiting_requests=len(self.waiting) - len(admitted), running_requests=len(self.running),
            queued_prefill_tokens=sum(len(r.prompt) - r.computed for r in self.running if r.in_prefill)
            + sum(len(r.prompt) for r in self.waiting), timestamp=time.time()))

        try:
            resp = self.cache.step(req)
        except Exception:
            self.retiring = retiring + self.retiring
            for r, lease_tokens, published in saved:
                r.lease_tokens, r.published = lease_tokens, published
            raise
        self.stats.steps += 1
        for res in resp.publishes:
            r = by_lease[res.lease_id]
            for remap in res.remaps:
                r.pages[remap.index] = remap.new_page
        # Checkpoints are stored before the copies run: an L3 write of a page reads its slot.
        for res in resp.checkpoints:
            self._store_checkpoint(by_lease[res.lease_id], res)
        self.tiers.run_copies(resp.copies)
        for r in retiring:
            self._after_release(r)
        lost = set(resp.expired_lease_ids)
        failed = {res.lease_id for res in resp.allocations if not res.ok}
        for res in resp.allocations:
            if res.ok:
                by_lease[res.lease_id].pages.extend(res.device_pages)
        loaded = self.tiers.load_extensions(list(resp.matches))
        for r, m, pages in zip(admitted, resp.matches, loaded, strict=True):
            self.waiting.remove(r)
            self._start(r, m, pages)
        for r in [r for r in self.running if r.lease in lost]:
            log.warning("event=lease_expired request=%s lease=%s", r.id, r.lease)
            r.lease = None
            self._preempt(r, released=True)
        for r in [r for r, _ in scheduled if r.lease in failed]:
            self._preempt(r, released=False)
        batch = [(r, n) for r, n in scheduled if r.status is Status.RUNNING and r.lease
                 and r.lease not in failed]
        if batch:
            self._forward(batch)

    def _publish_and_checkpoint_ops(self, req: pb.StepRequest, r: Request) -> None:
        full = r.computed // self.cfg.page_size
        append = r.tokens[r.lease_tokens:]
        if full > r.published or append:
            req.publishes.add(lease_id=r.lease, computed_pages=full,
                              packed_append_token_ids=np.asarray(append, dtype="<u4").tobytes())
            r.lease_tokens += len(append)
            r.published = max(r.published, full)
        for index in sorted(r.checkpoints):
            if index < r.published:
                req.checkpoints.add(lease_id=r.lease, page_index=index)

    def _waits_for_sibling(self, r: Request, admitted: list[Request]) -> bool:
        """Whether r shares whole pages with an in-flight sibling (same namespace) that will
        compute them and that nobody has published yet: r then waits for those publishes."""
        siblings = [s for s in self.running + admitted if (s.adapter, s.salt) == (r.adapter, r.salt)]
        if not siblings:
            return False
        mine, stride = r.token_bytes(), 4 * self.cfg.page_size
        usable = (r.num_tokens - 1) // self.cfg.page_size
        common = {id(s): common_pages(mine, s.token_bytes(), stride, usable) for s in siblings}
        published = max((min(common[id(s)], s.published) for s in siblings if s not in admitted),
                        default=0)
        return any(common[id(s)] > published for s in siblings if s.in_prefill or s in admitted)

    def _start(self, r: Request, m: pb.MatchResult, remote: list[PageData]) -> None:
        """Starts a matched request past its cached prefix and the L3 pages `remote` loaded into
        the first of m.remote_pages (the other remote pages are computed like new ones; they
        are the lease's already)."""
        r.status = Status.RUNNING
        r.lease, r.lease_tokens = m.lease_id, r.num_tokens
        r.pages = list(m.device_pages) + list(m.remote_pages)
        remote_tokens = len(remote) * self.cfg.page_size
        r.computed, r.published = m.cached_tokens + remote_tokens, len(m.device_pages)
        r.slot = heapq.heappop(self.free_slots)
        r.has_state = False
        if r.adapter:
            try:
                r.lora_slot = self.adapters.acquire(r.adapter)
            except AdapterNotFoundError:  # unloaded between admission and now
                self.running.append(r)
                self._finish(r, FinishReason.ABORT)
                self._retire(r)
                return
        if self.mamba and remote:
            self._resume_from_remote(r, len(m.device_pages), remote)
        elif self.mamba and m.mamba_slot >= 0 and m.cached_tokens:
            self._copy_state(self.cfg.max_running + m.mamba_slot, r.slot)
            r.has_state = True
        if not r.resumed:
            s = r.stats
            s.cached_tokens_device, s.cached_tokens_host = m.device_hit_tokens, m.host_hit_tokens
            s.cached_tokens_remote = remote_tokens
            if r.waited_on_sibling:
                s.shared_tokens_in_flight = m.cached_tokens
            self.stats.prompt_tokens += len(r.prompt)
            self.stats.cached_prompt_tokens += m.cached_tokens + remote_tokens
            self.stats.remote_loaded_tokens += remote_tokens
            self.stats.shared_in_flight_tokens += s.shared_tokens_in_flight
        r.resumed = True
        self.running.append(r)

    def _resume_from_remote(self, r: Request, first: int, remote: list[PageData]) -> None:
        """Puts the checkpoint of the last loaded page (TierMover guarantees it has one) into the
        running slot, and keeps the loaded checkpoints that this pool would have taken itself
        (every `checkpoint_every_pages`, and the deepest) to attach once the pages are
        published."""
        device = self.model.device
        for (ssm, conv), (s, c) in zip(self.states, remote[-1].mamba, strict=True):
            ssm[r.slot].copy_(s)
            conv[r.slot].copy_(c)
        r.has_state = True
        every = self.cfg.checkpoint_every_pages
        for i, page in enumerate(remote):
            index = first + i
            if page.mamba is not None and ((index + 1) % every == 0 or i == len(remote) - 1):
                r.checkpoints[index] = [(s.to(device), c.to(device)) for s, c in page.mamba]

    def _retire(self, r: Request) -> None:
        """Leaves the running set; its lease is published and released in the next step."""
        self.running.remove(r)
        self.retiring.append(r)

    def _after_release(self, r: Request) -> None:
        self._free_slots_of(r)
        r.lease, r.pages, r.checkpoints = None, [], {}
        if r.status is Status.WAITING:  # preempted: back to the front of the queue
            self._requeue(r)

    def _preempt(self, r: Request, released: bool) -> None:
        """Out of pages (or lease lost). A preempted request publishes what it computed and
        releases its lease in the next step, then matches again: only the unpublished tail is
        recomputed."""
        self.stats.preemptions += 1
        r.stats.preemptions += 1
        r.status = Status.WAITING
        self.running.remove(r)
        if released:  # the cache service already freed everything the lease held
            self._free_slots_of(r)
            r.pages, r.checkpoints = [], {}
            self._requeue(r)
        else:
            self.retiring.append(r)

    def _free_slots_of(self, r: Request) -> None:
        """Gives back the request's running Mamba slot and its adapter pin."""
        if r.slot >= 0:
            heapq.heappush(self.free_slots, r.slot)
            r.slot = -1
        if r.lora_slot >= 0:
            self.adapters.release(r.lora_slot)
            r.lora_slot = -1

    def _requeue(self, r: Request) -> None:
        r.computed = r.published = r.lease_tokens = 0
        r.has_state = False
        self.waiting.appendleft(r)

    # ---- tensors ----------------------------------------------------------------------------

    def _copy_state(self, src: int, dst: int) -> None:
        for ssm, conv in self.states:
            ssm[dst].copy_(ssm[src])
            conv[dst].copy_(conv[src])

    def _store_checkpoint(self, r: Request, res: pb.CheckpointResult) -> None:
        states = r.checkpoints.pop(res.page_index, None)
        if not res.ok or res.already_present:
            return
        dst = self.cfg.max_running + res.slot
        if states is None:  # the running slot holds the state at this page's end
            self._copy_state(r.slot, dst)
            return
        for (ssm, conv), (s, c) in zip(self.states, states, strict=True):
            ssm[dst].copy_(s)
            conv[dst].copy_(c)

    @torch.inference_mode()
    def _forward(self, batch: list[tuple[Request, int]]) -> None:
        P, device = self.cfg.page_size, self.model.device
        ids, positions, slots, cu, prefix = [], [], [], [0], []
        for r, n in batch:
            toks = r.tokens[r.computed:r.computed + n]
            ids += toks
            positions += range(r.computed, r.computed + n)
            slots += [r.pages[p // P] * P + p % P for p in range(r.computed, r.computed + n)]
            cu.append(cu[-1] + n)
            prefix.append(r.computed)
        width = max(len(r.pages) for r, _ in batch)
        decode = all(n == 1 and r.computed > 0 and (r.has_state or not self.mamba) for r, n in batch)
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        fb = ForwardBatch(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, cu_seqlens_q=i32(cu),
            prefix_lens=i32(prefix), block_tables=i32([r.pages + [0] * (width - len(r.pages)) for r, _ in batch]),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), kv_caches=self.kv,
            mamba_states=self.states, state_indices=i32([max(r.slot, 0) for r, _ in batch]),
            has_initial_state=torch.tensor([r.has_state for r, _ in batch], dtype=torch.bool, device=device),
            mamba_checkpoint_interval=P if self.mamba and not decode else 0,
            lora=(self.adapters.lora_batch([r.lora_slot for r, _ in batch], [n for _, n in batch])
                  if self.adapters is not None else None))
        out = self.model(torch.tensor(ids, dtype=torch.int64, device=device),
                         torch.tensor(positions, dtype=torch.int64, device=device), fb)
        self.stats.forward_tokens += len(ids)
        if out.mamba_boundaries is not None:
            self._keep_boundaries(batch, out.mamba_boundaries)
        ready = []
        for i, (r, n) in enumerate(batch):
            r.stats.computed_prompt_tokens += max(0, min(r.computed + n, len(r.prompt)) - r.computed)
            r.computed += n
            r.has_state = True
            if self.mamba and r.computed % P == 0:
                r.checkpoints[r.computed // P - 1] = None
            if r.computed == r.num_tokens:
                ready.append((i, r))
        if not ready:
            return
        rows, reqs = [i for i, _ in ready], [r for _, r in ready]
        for i, twin in self._twins([(i, r) for i, r in ready if not r.output]):
            rows.append(i)
            reqs.append(twin)
            twin.stats.first_token_from_twin = True
            self.stats.twin_first_tokens += 1
        logits = out.logits[rows]
        banned = [self._banned(r) for r in reqs]
        tokens = sample(logits.float(), [r.sampling for r in reqs], [r.generator for r in reqs], banned)
        for r, tok in zip(reqs, tokens, strict=True):
            self._emit(r, tok)

    def _twins(self, firsts: list[tuple[int, Request]]) -> list[tuple[int, Request]]:
        """(logits row, waiting twin) for the requests whose prompt completed in this forward:
        a twin has the same prompt and namespace and has sampled nothing; each is taken once."""
        if not firsts or not self.waiting or not self.cfg.twin_first_tokens:
            return []
        found = []
        for w in self.waiting:
            if w.output:
                continue
            for i, r in firsts:
                if w.prompt == r.prompt and (w.adapter, w.salt) == (r.adapter, r.salt):
                    found.append((i, w))
                    break
        return found

    def _keep_boundaries(self, batch, bounds) -> None:
        """Keeps the Mamba states at the page boundaries inside this call that should become
        checkpoints: every `checkpoint_every_pages` pages and the prompt's last whole page
        (lesson 8: positions are absolute, whichever chunk they fall in). The state at a chunk's
        end is the running slot's and is copied from there."""
        P, every = self.cfg.page_size, self.cfg.page_size * self.cfg.checkpoint_every_pages
        for k, (b, pos) in enumerate(zip(bounds.seq_index.tolist(), bounds.positions.tolist())):
            r, n = batch[b]
            if pos < r.computed + n and (pos % every == 0 or pos == len(r.prompt) // P * P):
                r.checkpoints[pos // P - 1] = [(s[k].clone(), c[k].clone())
                                               for s, c in zip(bounds.ssm, bounds.conv, strict=True)]

    def _banned(self, r: Request) -> tuple[int, ...]:
        if len(r.output) >= r.sampling.min_tokens:
            return ()
        return tuple(r.sampling.stop_token_ids) + (() if r.sampling.ignore_eos else self.eos)

    def _emit(self, r: Request, tok: int) -> None:
        now = time.monotonic()
        r.output.append(tok)
        if r.first_token_at is None:
            r.first_token_at = now
            r.stats.ttft_s = now - r.arrival
        delta = r.text.next(self.tokenizer, r.output)  # held back: an incomplete character
        sp = r.sampling
        reason = None
        if len(r.output) >= sp.min_tokens and (tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos)):
            reason = FinishReason.STOP
        elif len(r.output) >= sp.max_tokens or r.num_tokens >= self.cfg.max_context:
            reason = FinishReason.LENGTH
        r.sink(Output([tok], delta))
        if reason is not None:
            waiting = r.status is Status.WAITING  # a twin that got its first token (_twins)
            self._finish(r, reason)
            if waiting:
                self.waiting.remove(r)
            else:
                self._retire(r)

    def _finish(self, r: Request, reason: FinishReason) -> None:
        with self._lock:
            self._live.pop(r.id, None)
        r.status, r.finish = Status.FINISHED, reason
        s = r.stats
        s.output_tokens, s.finish_reason = len(r.output), reason
        s.total_s = time.monotonic() - r.arrival
        r.sink(Output([], r.text.flush(self.tokenizer, r.output), stats=s))

    # ---- the loop ---------------------------------------------------------------------------

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Steps until no request is left (tests and benchmarks; no background thread)."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def flush_l3(self, timeout_s: float = 10.0) -> bool:
        """Waits until every queued L3 write has been attempted (tests, benchmarks, drain)."""
        return self.l3.flush(timeout_s) if self.l3 is not None else True

    def tier_metrics(self) -> dict[str, float]:
        """L3 counters (prefixed `l3_`), for the server's metrics endpoint."""
        return {f"l3_{k}": v for k, v in self.l3.metrics().items()} if self.l3 is not None else {}

    def close(self) -> None:
        """Stops the loop, then the L3 writer once it has attempted its queue."""
        self.stop()
        if self.l3 is not None:
            self.l3.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the loop; requests still queued or running end with ABORT."""
        with self._lock:
            self._stopped = True
            self._wakeup.notify()
        if self._thread:
            self._thread.join(timeout=30)
        self._fail_all()

    def _loop(self) -> None:
        failures = 0
        while True:
            with self._lock:
                while not self.has_work() and not self._stopped:
                    self._wakeup.wait()
                if self._stopped:
                    return
            try:
                if self._pool_unknown:
                    self._reset_pool()
                self.step()
                failures = 0
            except Exception as exc:  # a failed step must not kill the worker silently
                failures += 1
                log.exception("event=step_failed failures=%d", failures)
                # A rejected step changed nothing; anything else (pool lost, cache service
                # unreachable: the step may or may not have been applied, and it is not
                # idempotent) means starting over under a new epoch.
                rejected = isinstance(exc, CacheError) and exc.code not in (
                    ErrorCode.NOT_FOUND, ErrorCode.FAILED_PRECONDITION)
                self._pool_unknown = self._pool_unknown or not rejected
                if failures >= self.MAX_STEP_FAILURES:
                    self._fail_all()
                    failures = 0
                time.sleep(min(0.05 * 2 ** failures, 2.0))

    MAX_STEP_FAILURES = 8

    def _reset_pool(self) -> None:
        """Registers a new epoch, then recomputes every running request from what the new pool
        holds (the old leases are gone or will expire)."""
        self._register()
        self._pool_unknown = False
        self.stats.recoveries += 1
        log.warning("event=pool_reregistered epoch=%d running=%d", self.epoch, len(self.running))
        for r in list(self.running):
            self._preempt(r, released=True)
        for r in self.retiring:
            self._free_slots_of(r)
            if r.status is Status.WAITING:
                self._requeue(r)
        self.retiring.clear()

    def _fail_all(self) -> None:
        """Ends every request with ABORT and frees what they held (their leases expire)."""
        for r in list(self.running) + list(self.waiting) + list(self.retiring):
            self._free_slots_of(r)
            if r.status is not Status.FINISHED:
                self._finish(r, FinishReason.ABORT)
        self.running.clear()
        self.waiting.clear()
        self.retiring.clear()
        with self._lock:
            for r in self._inbox:
                r.status = Status.FINISHED
            pending, self._inbox = self._inbox, []
        for r in pending:
            self._finish(r, FinishReason.ABORT)
