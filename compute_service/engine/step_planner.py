"""The step planner: builds the one batched `StepRequest` of an engine step from the scheduler's
state and decisions, sends it (the in-process CacheCore, the gRPC CacheClient: same messages,
or the engine's own LocalPages with prefix caching off) and applies the `StepResponse`.

The ops of one step, in the order they are built:
1. `publish`: for requests retiring (finished, aborted, preempted) a final publish, their pending
   Mamba checkpoints and a release; for running requests the publish of every newly computed
   full page (design.md lesson 1: during prefill, not at the end) and their checkpoints. Built
   before the scheduler decides: the sibling rule reads what they publish.
2. `allocate_and_match`: page allocations, matches for the admitted waiting requests, renewals
   of leases near their TTL, and the load report when it changed.
3. `send`: one `cache.step(...)`, or none when the step has nothing to say. If it raises, nothing
   was applied here: the fields building the ops advanced (`lease_tokens`, `published`) and the
   retiring queue are restored, so the next step builds the same ops again (the engine decides
   whether the pool is still known).
4. `receive`: wait for the answer and apply it: re-point remapped pages, store checkpoints into
   the slots it gave, run the page copies it returns (demotions, load-backs, L3 writes:
   compute_service.tiers), free what the released leases held, give allocated pages, load the L3
   extensions of this step's matches (one batched load for all of them), start matched requests
   (their cached prefix, L3 pages included, is skipped whole, design.md lesson 9: `computed`
   starts at the cached length), preempt requests whose lease expired, and make room for those
   it could not give the pages this step's forward needs (Scheduler.make_room: the youngest
   running request is preempted, never an older one for a younger).

What keeps the call cheap (a decode step usually has nothing to say):
- a publish carries only the tokens of the pages it publishes (`lease_tokens` trails the
  request's tokens by up to a page), so a decode step that completes no page publishes nothing;
- pages are allocated when a request crosses a page boundary, and for a request that samples in
  this step, one step ahead: the page its next decode token needs (a "lookahead" allocation;
  its failure preempts nothing, the next step asks again for the page it then needs now);
- an overlapped call also publishes the page its own forward completes with a decode token
  (`_publish_ahead`), with that page's checkpoint, so a decode needs one call per page, which
  carries the publish, the checkpoint and the lookahead allocation together;
- a lease is renewed only once `RENEW_FRACTION` of its TTL passed since a call last named it
  (any op naming a lease renews it), so a step may take up to 3/4 of the TTL;
- the load report rides along any call; alone, only when it changed or after `LOAD_REFRESH_S`;
  so do the L3 writes the worker could not do (`failed_remote_writes`), never alone;
- a step with nothing to say sends no call at all.

Overlap (`EngineConfig.overlap_cache_calls`, prefix caching on): a step whose forward needs no
answer from the call (no allocation is needed now: decode steps, matches, publishes, releases,
lookahead allocations) sends it on the `CacheCaller` thread and runs the forward meanwhile; the
answer is applied after the forward, before the step's tokens are emitted. A step that needs
pages now (a prefill chunk, a retried allocation) waits for its call before the forward. Why the
overlap is safe:
- the forward's batch is fixed before the call (every scheduled request holds its pages);
- nothing the call changes is read or written by that forward but what it expects: pages it
  publishes are complete, or completed by this very forward (`_publish_ahead`: they are read by
  a later forward only); pages it frees (remaps, releases, expired leases, evictions) or hands
  out (allocations, matches) are used only by a later forward, after the answer was applied;
  the copies it returns touch only such pages and published ones, and run after the forward;
- checkpoints: a kept "running slot's state" (a decode that ended on a page in an earlier step)
  is snapshot before the forward, which moves the running slot on; the checkpoint of the page
  this forward completes is copied from the running slot when the answer is applied, which is
  exactly the state at that page's end;
- a request admitted in the call stays in `waiting` until the answer starts it, so a twin may
  take its first token from this forward: it is then started with the tokens its match sent,
  and the token is appended after (a lease learns later tokens through publishes);
- a request whose lease the answer reports expired is requeued before its token is emitted
  (`Scheduler.emit` handles a token for a waiting request).
A forward that raises after an overlapped call published ahead leaves pages in the tree that it
did not fill: the engine's loop treats any such failure as a lost pool and re-registers under a
new epoch (`Engine._loop`). The calls of one engine are strictly sequential: a step's answer is
applied before the step ends, so between steps no call is in flight.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from compute_service.engine.cache_caller import CacheCaller
from compute_service.engine.config import EngineConfig, EngineStats
from compute_service.engine.model_runner import ModelRunner
from compute_service.engine.request import Request, Status
from compute_service.engine.scheduler import Scheduler
from compute_service.engine.step_traces import end_l3_span, l3_span, step_span
from compute_service.tiers import PageData
from compute_service.tiers.mover import TierMover
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from service_shell import tracing

log = logging.getLogger("compute_service.engine")

# The cache service's lease TTL when the pool registers none (its DEFAULT_LEASE_TTL_S;
# tests/compute_service/engine/test_cache_calls.py keeps them equal).
SERVICE_LEASE_TTL_S = 30.0
RENEW_FRACTION = 0.25  # of the TTL: late enough to skip most steps, early enough for slow ones
LOAD_REFRESH_S = 5.0  # a call with nothing else to say, to keep the report's timestamp fresh
MAX_FAILED_REPORT = 4096  # failed L3 writes reported per call (the service takes 65536)

_EMPTY = pb.StepResponse()


@dataclass(slots=True)
class StepPlan:
    """One step's cache ops and what they were built from."""
    req: pb.StepRequest
    retiring: list[Request]  # taken from the scheduler: released by this step
    by_lease: dict[str, Request] = field(default_factory=dict)  # every lease an op names
    # (request, lease_tokens, published) before its publish was built: the rollback.
    saved: list[tuple[Request, int, int]] = field(default_factory=list)
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    match_tokens: list[int] = field(default_factory=list)  # tokens each match op sent
    now: set[str] = field(default_factory=set)  # leases whose allocation this forward needs
    slot_checkpoints: list[tuple[Request, int]] = field(default_factory=list)  # see module doc
    load: tuple[int, int, int] | None = None  # the load report sent, if any
    sent_at: float = 0.0
    overlapped: bool = False
    future: Future | None = None
    resp: pb.StepResponse | None = None  # the answer of a call that is not overlapped
    span: object | None = None  # its cache.Step span while the call runs (step_traces)


def _end(plan: StepPlan) -> None:
    if plan.span is not None:
        plan.span.end()
        plan.span = None


class StepPlanner:
    def __init__(self, cfg: EngineConfig, cache, scheduler: Scheduler, runner: ModelRunner,
                 tiers: TierMover, stats: EngineStats):
        self.cfg, self.cache, self.sched, self.runner = cfg, cache, scheduler, runner
        self.tiers, self.stats = tiers, stats
        self.caller = CacheCaller(cache)
        # False with prefix caching off, and while the engine serves without its cache service
        # (Engine._serve_locally): no publishes, checkpoints, renewals or load reports.
        self.caching = cfg.prefix_cache
        self.renew_after_s = RENEW_FRACTION * (cfg.lease_ttl_s or SERVICE_LEASE_TTL_S)
        self._load: tuple[int, int, int] | None = None  # the last load report the cache took
        self._load_at = 0.0

    def reset(self) -> None:
        """The pool was registered again (a new epoch): it has no load report yet."""
        self._load = None

    # ---- building the ops --------------------------------------------------------------------

    def publish(self, epoch: int) -> StepPlan:
        """Step 1: publishes and checkpoints of retiring and running requests, releases of the
        retiring ones (whose queue this plan now holds)."""
        sched = self.sched
        plan = StepPlan(pb.StepRequest(pool_id=self.cfg.pool_id, epoch=epoch), sched.retiring)
        sched.retiring = []
        if self.caching:
            for r in plan.retiring:
                self._publish_and_checkpoint_ops(plan, r)
            for r in sched.running:
                if r.computed // self.cfg.page_size > r.published or r.checkpoints:
                    self._publish_and_checkpoint_ops(plan, r)
        for r in plan.retiring:
            plan.by_lease[r.lease] = r
            plan.req.releases.add(lease_id=r.lease)
        return plan

    def _publish_and_checkpoint_ops(self, plan: StepPlan, r: Request) -> None:
        """Publishes r's new full pages, appending the tokens of those pages the lease has not
        seen; asks for a slot for each kept checkpoint of a page published by now."""
        P = self.cfg.page_size
        full = r.computed // P
        if full > r.published:
            plan.saved.append((r, r.lease_tokens, r.published))
            plan.by_lease[r.lease] = r
            append = r.token_bytes()[4 * r.lease_tokens:4 * full * P]
            plan.req.publishes.add(lease_id=r.lease, computed_pages=full,
                                   packed_append_token_ids=append)
            r.lease_tokens += len(append) // 4
            r.published = full
        for index in sorted(r.checkpoints):
            if index < r.published:
                plan.by_lease[r.lease] = r
                plan.req.checkpoints.add(lease_id=r.lease, page_index=index)
                if r.checkpoints[index] is None:
                    plan.slot_checkpoints.append((r, index))

    def allocate_and_match(self, plan: StepPlan) -> None:
        """Step 2: pages for the scheduled tokens (and one step ahead), matches for the admitted,
        renewals of the running leases near their TTL, and the load report."""
        req, P, sched = plan.req, self.cfg.page_size, self.sched
        for r, n in plan.scheduled:
            end = r.computed + n
            need = -(-end // P) - len(r.pages)
            if need > 0:
                plan.now.add(r.lease)
            elif end == r.num_tokens and len(r.pages) * P <= end and self._decodes_again(r):
                need = 1  # its next token starts a page: lookahead
            if need > 0:
                plan.by_lease[r.lease] = r
                req.allocations.add(lease_id=r.lease, num_pages=need)
        for r in plan.admitted:
            plan.match_tokens.append(r.num_tokens)
            req.matches.add(request_id=r.id, packed_token_ids=r.token_bytes(), is_resume=r.resumed,
                            omit_page_hashes=True, retain_s=r.retain_s,
                            namespace=common_pb2.Namespace(adapter=r.adapter, salt=r.salt))
        if not self.caching:
            return  # local pages: no lease expires, and no subscriber reads the load
        now = time.monotonic()
        for r in sched.running:
            if now - r.renewed_at >= self.renew_after_s and r.lease not in plan.by_lease:
                plan.by_lease[r.lease] = r
                req.renew_lease_ids.append(r.lease)
        plan.load = (len(sched.waiting) - len(plan.admitted), len(sched.running),
                     sum(len(r.prompt) - r.computed for r in sched.running if r.in_prefill)
                     + sum(len(r.prompt) for r in sched.waiting))

    @staticmethod
    def _has_ops(req: pb.StepRequest) -> bool:
        return bool(req.publishes or req.checkpoints or req.releases or req.renew_lease_ids
                    or req.matches or req.allocations)

    def _decodes_again(self, r: Request) -> bool:
        """Whether r, sampling a token in this step, will compute it in the next one."""
        return (len(r.output) + 1 < r.sampling.max_tokens
                and r.num_tokens + 1 < self.cfg.max_context)

    # ---- the call ----------------------------------------------------------------------------

    def send(self, plan: StepPlan) -> None:
        """Step 3: nothing when the step has nothing to say; the call on the caller thread when
        the step's forward needs none of its answer (see the module docstring); else the call,
        now (raising with the ops undone)."""
        req = plan.req
        overlap = (self.cfg.overlap_cache_calls and self.caching and not plan.now
                   and bool(plan.scheduled))
        if overlap:
            self._publish_ahead(plan)
        has_ops = self._has_ops(req)
        # The load report rides along any call; alone, only when it changed or went stale.
        if plan.load is not None and (has_ops or plan.load != self._load
                                      or time.monotonic() - self._load_at >= LOAD_REFRESH_S):
            req.load.CopyFrom(common_pb2.LoadReport(
                waiting_requests=plan.load[0], running_requests=plan.load[1],
                queued_prefill_tokens=plan.load[2], timestamp=time.time()))
        else:
            plan.load = None
            if not has_ops:
                plan.resp = _EMPTY
                return
        plan.sent_at = time.monotonic()
        self.stats.cache_calls += 1
        if self.caching:  # rides along a call, never one of its own (lost if the call fails:
            # the pool is registered again then, its tree empty)
            req.failed_remote_writes = self.tiers.failed_writes(MAX_FAILED_REPORT)
        plan.span = step_span(req, [*plan.admitted, *plan.by_lease.values()])
        if overlap:
            for r, index in plan.slot_checkpoints:  # the forward moves the running slot on
                r.checkpoints[index] = self.runner.snapshot_state(r.slot)
            plan.overlapped = True
            self.stats.cache_calls_overlapped += 1
            plan.future = self.caller.submit(req, tracing.context_of(plan.span))
            return
        started = time.perf_counter()
        token = tracing.attach(tracing.context_of(plan.span))  # a remote cache sends it on
        try:
            plan.resp = self.cache.step(req)
        except Exception:
            self._undo(plan)
            raise
        finally:
            self.stats.cache_wait_s += time.perf_counter() - started
            tracing.detach(token)
            _end(plan)

    def _publish_ahead(self, plan: StepPlan) -> None:
        """An overlapped call also publishes the page each decode token of its forward completes
        (and asks for its checkpoint slot, which the running slot fills once the forward is
        done: model_runner), so a decode needs one call per page, not two."""
        P, ops = self.cfg.page_size, None
        for r, n in plan.scheduled:
            end = r.computed + n
            if n != 1 or end % P or end // P <= r.published:
                continue
            if ops is None:
                ops = {op.lease_id: op for op in plan.req.publishes}
            op = ops.get(r.lease)
            if op is None:
                plan.saved.append((r, r.lease_tokens, r.published))
                plan.by_lease[r.lease] = r
                op = ops[r.lease] = plan.req.publishes.add(lease_id=r.lease)
            append = r.token_bytes()[4 * r.lease_tokens:4 * end]
            op.packed_append_token_ids += append
            op.computed_pages = end // P
            r.lease_tokens += len(append) // 4
            r.published = end // P
            if self.runner.checkpoints:
                plan.req.checkpoints.add(lease_id=r.lease, page_index=r.published - 1)

    def _undo(self, plan: StepPlan) -> None:
        self.sched.retiring = plan.retiring + self.sched.retiring
        for r, lease_tokens, published in plan.saved:
            r.lease_tokens, r.published = lease_tokens, published

    def batch(self, plan: StepPlan) -> list[tuple[Request, int]]:
        """The forward's batch: the scheduled requests still running with their pages (a
        request short of pages sits this forward out: Scheduler.make_room)."""
        return [(r, n) for r, n in plan.scheduled
                if r.status is Status.RUNNING and r.lease and not r.short_of_pages]

    # ---- applying the answer -----------------------------------------------------------------

    def receive(self, plan: StepPlan) -> None:
        """Step 4: waits for an overlapped call (raising with the ops undone), then applies the
        answer."""
        if plan.future is not None:
            started = time.perf_counter()
            try:
                plan.resp = plan.future.result()
            except Exception:
                self._undo(plan)
                raise
            finally:
                self.stats.cache_wait_s += time.perf_counter() - started
                plan.future = None
                _end(plan)
        self._apply(plan, plan.resp)

    def _apply(self, plan: StepPlan, resp: pb.StepResponse) -> None:
        sched, by_lease = self.sched, plan.by_lease
        self.stats.steps += 1
        if resp is _EMPTY:
            return
        for res in resp.publishes:
            r = by_lease[res.lease_id]
            for remap in res.remaps:
                r.pages[remap.index] = remap.new_page
        # Checkpoints are stored before the copies run: an L3 write of a page reads its slot.
        if resp.checkpoints:
            self.runner.store_checkpoints([(by_lease[res.lease_id], res)
                                           for res in resp.checkpoints])
        if resp.copies:
            self.tiers.run_copies(resp.copies)
        for r in plan.retiring:
            sched.after_release(r)
        failed = []
        for res in resp.allocations:
            r = by_lease[res.lease_id]
            if res.ok:
                r.pages.extend(res.device_pages)
                r.short_of_pages = False
            elif res.lease_id in plan.now:  # a lookahead that failed is asked for again
                failed.append(r)
        if resp.matches:
            span = l3_span(plan.admitted, resp.matches)
            loaded = self.tiers.load_extensions(list(resp.matches))
            end_l3_span(span, loaded)
            for r, m, pages, n in zip(plan.admitted, resp.matches, loaded, plan.match_tokens,
                                      strict=True):
                self._start(r, m, pages, n)
        if resp.expired_lease_ids:
            lost = set(resp.expired_lease_ids)
            for r in [r for r in sched.running if r.lease in lost]:
                log.warning("event=lease_expired request=%s lease=%s", r.id, r.lease)
                r.lease = None
                sched.preempt(r, released=True)
        sched.make_room([r for r in failed if r.status is Status.RUNNING and r.lease])
        for r in by_lease.values():  # every op naming a lease renews it
            r.renewed_at = plan.sent_at
        if plan.load is not None:
            self._load, self._load_at = plan.load, plan.sent_at

    def _start(self, r: Request, m: pb.MatchResult, remote: list[PageData],
               lease_tokens: int) -> None:
        """Starts a matched request past its cached prefix and the L3 pages `remote` loaded into
        the first of m.remote_pages (the other remote pages are computed like new ones; they
        are the lease's already), with the Mamba state of where it resumes. `lease_tokens`:
        the tokens its match sent (a twin may have sampled one since)."""
        runner = self.runner
        remote_tokens = len(remote) * self.cfg.page_size
        if not self.sched.start(r, m.lease_id, list(m.device_pages) + list(m.remote_pages),
                                lease_tokens, computed=m.cached_tokens + remote_tokens,
                                published=len(m.device_pages)):
            return
        r.renewed_at = time.monotonic()
        if runner.mamba and remote:
            runner.resume_from_remote(r, len(m.device_pages), remote)
        elif runner.mamba and m.mamba_slot >= 0 and m.cached_tokens:
            runner.copy_state(self.cfg.max_running + m.mamba_slot, r.slot)
            r.has_state = True
        if not r.resumed:  # a preempted request's hits were counted at its first match
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
