"""The scheduler: which requests compute how many tokens in a step, which waiting requests are
admitted, and every move of a request between its queues. It holds no tensors and makes no cache
call: the step planner turns its decisions into cache ops and applies the answer through
`start`, `preempt` and `after_release`.

Queues (touched by the engine thread only; other threads only read their lengths):
- `waiting`: not matched: new, held back (sibling rule, adapter limit), or preempted (at the
  front). A waiting request holds no lease, no pages and no slot.
- `running`: holds a lease, pages covering `computed` tokens, a running Mamba slot and its adapter
  pin (Request's invariants). At most `max_running`.
- `retiring`: left `running` (finished, aborted or preempted) and still holds its lease and
  slots: the next step publishes what it computed and its pending checkpoints and releases the
  lease; only then are its slots freed and a preempted one requeued at the front of `waiting`.
A request is in at most one queue; a finished one leaves the queues once its lease is released.
Between steps `free_slots` holds exactly the running slots no running or retiring request holds.

The token budget (per step) counts computed tokens only: decoding requests first (one token each),
then prefill chunks, oldest first; each computes `min(remaining, budget left)`, where remaining is
the tokens not yet in its KV. A cached prefix costs nothing, however long (design.md lesson 9).

Same-step deduplication (the sibling rule): a waiting request that shares whole pages with a
running (or just admitted) request that has not published them yet waits for those publishes
instead of computing the same pages; it then matches them as a cache hit
(`shared_tokens_in_flight`). Not with prefix caching off: nothing is ever published there.

Twins (N samples of one prompt, as RL rollouts send them): when a request's prompt completes, every
waiting request with the same prompt in the same namespace that has sampled nothing yet samples
its first token from the same logits row, with its own sampling parameters and generator, in the
same step (the model runner does the sampling; `twins` finds them). It is then admitted like any
sibling (it matches the published pages and computes the prompt's partial last page and that
token), so its first token no longer waits for a step of its own (`first_token_from_twin`).

Preemption: a request whose lease expired goes back to `waiting`. When the cache service cannot
give a request the pages this step's forward needs, the youngest running request (by submission,
`Request.seq`) is preempted instead, unless the short one is itself the youngest (`make_room`):
the older one sits out this forward, retries its allocation in the next step, and no waiting
request is admitted until it has its pages. So the oldest running request is never preempted for
a younger one and gains tokens every few steps; as `Engine.submit` rejects a request that cannot
fit in the pool alone, every admitted request finishes (two requests that each fit alone
used to take each other's pages forever under chunked prefill). A preempted request with its
lease still held retires first, publishing what it computed, so when it matches again only the
unpublished tail is recomputed.
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable

from compute_service.engine.config import EngineConfig, EngineStats
from compute_service.engine.logits_ops import TokenLogprobs
from compute_service.engine.request import FinishReason, Output, Request, Status
from compute_service.lora import AdapterNotFoundError, AdapterRegistry
from compute_service.model import Tokenizer
from prefixcache_client.pages import common_pages


class Scheduler:
    def __init__(self, cfg: EngineConfig, stats: EngineStats, tokenizer: Tokenizer,
                 eos: tuple[int, ...], adapters: AdapterRegistry | None,
                 forget: Callable[[str], None]):
        """`forget(request_id)` drops a finished request from the engine's registry of live ids
        (under the engine's lock), before its last output is sent: a client that saw it may
        reuse the id at once."""
        self.cfg, self.stats, self.tokenizer, self.eos = cfg, stats, tokenizer, eos
        self.caching = cfg.prefix_cache  # False while the engine serves without its cache service
        self.adapters = adapters
        self._forget = forget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.retiring: list[Request] = []
        # A min-heap: the lowest free slot first, so that a steady batch's slots tend to form one
        # run, which the CPU Mamba update serves in place (kernels.mamba_torch).
        self.free_slots = list(range(cfg.max_running))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.retiring)

    def adapter_names(self) -> list[str]:
        return self.adapters.names() if self.adapters is not None else []

    # ---- a step's decisions ------------------------------------------------------------------

    def abort(self, ids: set[str]) -> None:
        """Ends the requests named in `ids`: a waiting one at once, a running one retires (its
        lease is released in this step), a preempted one waiting for its release is not
        requeued after it."""
        for r in list(self.waiting):
            if r.id in ids:
                self.waiting.remove(r)
                self.finish(r, FinishReason.ABORT)
        for r in list(self.running):
            if r.id in ids:
                self.finish(r, FinishReason.ABORT)
                self.retire(r)
        for r in self.retiring:
            if r.id in ids and r.status is Status.WAITING:
                self.finish(r, FinishReason.ABORT)

    def schedule(self) -> tuple[list[tuple[Request, int]], list[Request]]:
        """(running request, tokens it computes) within the token budget, and the waiting
        requests admitted (to be matched in this step). Runs after the step's publishes were
        built: the sibling rule reads `published`."""
        scheduled: list[tuple[Request, int]] = []
        budget = self.cfg.token_budget
        # Decoding requests first (one token each), then prefill chunks, oldest first.
        for r in sorted(self.running, key=lambda r: (r.num_tokens - r.computed > 1, r.arrival)):
            n = min(r.num_tokens - r.computed, budget)
            if n <= 0:
                continue
            budget -= n
            scheduled.append((r, n))
        return scheduled, self._admit()

    def _admit(self) -> list[Request]:
        cfg = self.cfg
        admitted: list[Request] = []
        room = min(cfg.max_running - len(self.running), len(self.free_slots))
        adapters = {r.adapter for r in self.running if r.adapter}
        if any(r.short_of_pages for r in self.running):
            return admitted  # a newcomer would take the pages an older request waits for
        for r in list(self.waiting):
            if len(admitted) >= room:
                break
            if r.adapter and r.adapter not in adapters and len(adapters) >= cfg.max_loras:
                continue  # the step already runs max_loras adapters: wait, holding nothing
            if r.adapter and r.adapter not in self.adapter_names():
                self.waiting.remove(r)  # unloaded while it waited
                self.finish(r, FinishReason.ABORT)
                continue
            if self.caching and self._waits_for_sibling(r, admitted):
                r.waited_on_sibling = True
                continue
            admitted.append(r)
            if r.adapter:
                adapters.add(r.adapter)
        return admitted

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

    def twins(self, firsts: list[tuple[int, Request]]) -> list[tuple[int, Request]]:
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

    # ---- moves between the queues ------------------------------------------------------------

    def start(self, r: Request, lease: str, pages: list[int], lease_tokens: int, computed: int,
              published: int) -> bool:
        """Moves a matched request from `waiting` to `running` with its lease (which knows its
        first `lease_tokens` tokens) and pages, a running slot and its adapter pin. False when
        its adapter was unloaded since admission: it then ends with ABORT and retires (its
        lease is released in the next step)."""
        self.waiting.remove(r)
        r.status = Status.RUNNING
        if r.scheduled_at is None:  # a preempted request resuming keeps its first start
            r.scheduled_at = time.monotonic()
        r.lease, r.lease_tokens = lease, lease_tokens
        r.pages, r.computed, r.published = pages, computed, published
        r.slot = heapq.heappop(self.free_slots)
        r.has_state = False
        self.running.append(r)
        if r.adapter:
            try:
                r.lora_slot = self.adapters.acquire(r.adapter)
            except AdapterNotFoundError:  # unloaded between admission and now
                self.finish(r, FinishReason.ABORT)
                self.retire(r)
                return False
        return True

    def retire(self, r: Request) -> None:
        """Leaves the running set; its lease is published and released in the next step."""
        self.running.remove(r)
        self.retiring.append(r)

    def after_release(self, r: Request) -> None:
        """A retiring request's lease was released: its slots are free, and a preempted one goes
        back to the front of the queue."""
        self._free_slots_of(r)
        r.lease, r.pages, r.checkpoints = None, [], {}
        if r.status is Status.WAITING:
            self._requeue(r)

    def make_room(self, short: list[Request]) -> None:
        """`short`: running requests the cache service could not give the pages this step's
        forward needs. Oldest first, each one preempts the youngest running request, or itself
        when it is the youngest; a short request that stays running is marked
        `short_of_pages` (see the module docstring)."""
        for r in sorted(short, key=lambda r: r.seq):
            if r.status is not Status.RUNNING:
                continue  # preempted for an older one in this loop
            victim = max(self.running, key=lambda r: r.seq)
            if victim is not r:
                r.short_of_pages = True
            self.preempt(victim, released=False)

    def preempt(self, r: Request, released: bool) -> None:
        """Out of pages (or lease lost). `released`: the cache service already freed everything
        the lease held, so it is requeued now; else it retires first (see the module
        docstring)."""
        self.stats.preemptions += 1
        r.stats.preemptions += 1
        r.status = Status.WAITING
        r.short_of_pages = False
        self.running.remove(r)
        if released:
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

    def requeue_all(self) -> None:
        """The pool was lost (re-registered under a new epoch): every request holding a lease is
        requeued and recomputed from what the new pool holds; the old leases are gone or will
        expire."""
        for r in list(self.running):
            self.preempt(r, released=True)
        for r in self.retiring:
            self._free_slots_of(r)
            if r.status is Status.WAITING:
                self._requeue(r)
        self.retiring.clear()

    def abort_all(self) -> None:
        """Ends every queued request with ABORT and frees what they held (leases expire)."""
        for r in list(self.running) + list(self.waiting) + list(self.retiring):
            self._free_slots_of(r)
            if r.status is not Status.FINISHED:
                self.finish(r, FinishReason.ABORT)
        self.running.clear()
        self.waiting.clear()
        self.retiring.clear()

    # ---- outputs -----------------------------------------------------------------------------

    def emit(self, r: Request, tok: int, logprobs: TokenLogprobs | None = None) -> None:
        """Appends a sampled token, streams it, and ends the request on a stop token or its
        length (a twin that stops at its first token leaves `waiting` without ever running)."""
        now = time.monotonic()
        r.output.append(tok)
        if r.first_token_at is None:
            r.first_token_at = now
            r.stats.ttft_s = now - r.arrival
            started = r.scheduled_at if r.scheduled_at is not None else now
            r.stats.queue_s, r.stats.prefill_s = started - r.arrival, now - started
        else:
            r.stats.token_gaps_s.append(now - r.last_token_at)
        r.last_token_at = now
        delta = r.text.next(self.tokenizer, r.output)  # held back: an incomplete character
        sp = r.sampling
        reason = None
        if len(r.output) >= sp.min_tokens and (tok in sp.stop_token_ids
                                               or (not sp.ignore_eos and tok in self.eos)):
            reason = FinishReason.STOP
        elif len(r.output) >= sp.max_tokens or r.num_tokens >= self.cfg.max_context:
            reason = FinishReason.LENGTH
        r.sink(Output([tok], delta, logprobs=None if logprobs is None else [logprobs]))
        if reason is not None:
            waiting = r.status is Status.WAITING  # a twin that got its first token
            self.finish(r, reason)
            if waiting:
                self.waiting.remove(r)
            else:
                self.retire(r)

    def finish(self, r: Request, reason: FinishReason) -> None:
        """Ends the request and sends its last output (the held-back text and its stats); its
        queue moves are the caller's."""
        self._forget(r.id)
        r.status, r.finish = Status.FINISHED, reason
        s = r.stats
        s.output_tokens, s.finish_reason = len(r.output), reason
        s.total_s = time.monotonic() - r.arrival
        if r.first_token_at is not None:
            s.decode_s = r.last_token_at - r.first_token_at
        elif r.scheduled_at is None:  # aborted while it waited: all of it was queue
            s.queue_s = s.total_s
        r.sink(Output([], r.text.flush(self.tokenizer, r.output), stats=s))
