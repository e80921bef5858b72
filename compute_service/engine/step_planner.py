"""The step planner: builds the one batched `StepRequest` of an engine step from the scheduler's
state and decisions, sends it (the in-process CacheCore or the gRPC CacheClient: same messages),
and applies the `StepResponse`.

The ops of one step, in the order they are built:
1. `publish`: for requests retiring (finished, aborted, preempted) a final publish, their pending
   Mamba checkpoints and a release; for running requests the publish of every newly computed
   full page (design.md lesson 1: during prefill, not at the end) and their checkpoints. Built
   before the scheduler decides: the sibling rule reads what they publish.
2. `allocate_and_match`: page allocations for the scheduled tokens, matches for the admitted
   waiting requests, renewals of the other running leases, and the load report.
3. `send`: one `cache.step(...)`. If it raises, nothing was applied here: the fields building
   the ops advanced (`lease_tokens`, `published`) and the retiring queue are restored, so the
   next step builds the same ops again (the engine decides whether the pool is still known).
4. `apply`: re-point remapped pages, store checkpoints into the slots it gave, run the page
   copies it returns (demotions, load-backs, L3 writes: compute_service.tiers), free what the
   released leases held, give allocated pages, load the L3 extensions of this step's matches
   (one batched load for all of them), start matched requests (their cached prefix, L3 pages
   included, is skipped whole, design.md lesson 9: `computed` starts at the cached length),
   preempt requests whose lease expired or that it could not give pages. Returns the batch to
   forward: the scheduled requests still running with their pages.

Tiers: with `host_pages` the cache service demotes evicted pages to a host pool and loads host
hits back through the step's copies. With an L3 client, the pool is registered with the
configured write policy and lookup; L3 writes are gathered in the step and finished in the
background; an L3 page that is missing, invalid, or behind a Redis failure is computed instead
(requests never fail because of Redis).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from compute_service.engine.config import EngineConfig, EngineStats
from compute_service.engine.model_runner import ModelRunner
from compute_service.engine.request import Request, Status
from compute_service.engine.scheduler import Scheduler
from compute_service.tiers import PageData
from compute_service.tiers.mover import TierMover
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2

log = logging.getLogger("compute_service.engine")


@dataclass(slots=True)
class StepPlan:
    """One step's cache ops and what they were built from."""
    req: pb.StepRequest
    retiring: list[Request]  # taken from the scheduler: released by this step
    by_lease: dict[str, Request] = field(default_factory=dict)
    # (request, lease_tokens, published) before the publishes were built: the rollback.
    saved: list[tuple[Request, int, int]] = field(default_factory=list)
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)


class StepPlanner:
    def __init__(self, cfg: EngineConfig, cache, scheduler: Scheduler, runner: ModelRunner,
                 tiers: TierMover, stats: EngineStats):
        self.cfg, self.cache, self.sched, self.runner = cfg, cache, scheduler, runner
        self.tiers, self.stats = tiers, stats

    # ---- building the ops --------------------------------------------------------------------

    def publish(self, epoch: int) -> StepPlan:
        """Step 1: publishes and checkpoints of retiring and running requests, releases of the
        retiring ones (whose queue this plan now holds)."""
        sched = self.sched
        plan = StepPlan(pb.StepRequest(pool_id=self.cfg.pool_id, epoch=epoch), sched.retiring)
        sched.retiring = []
        for r in plan.retiring + sched.running:
            plan.saved.append((r, r.lease_tokens, r.published))
        for r in plan.retiring + sched.running:
            plan.by_lease[r.lease] = r
            self._publish_and_checkpoint_ops(plan.req, r)
        plan.req.releases.extend(pb.ReleaseOp(lease_id=r.lease) for r in plan.retiring)
        return plan

    def _publish_and_checkpoint_ops(self, req: pb.StepRequest, r: Request) -> None:
        """Publishes r's new full pages and appends its tokens the lease has not seen; asks for a
        slot for each kept checkpoint of a page published by now (the tree holds it)."""
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

    def allocate_and_match(self, plan: StepPlan) -> None:
        """Step 2: pages for the scheduled tokens, matches for the admitted, lease renewals of
        the running requests no other op touches, and the load report."""
        req, P, sched = plan.req, self.cfg.page_size, self.sched
        for r, n in plan.scheduled:
            need = -(-(r.computed + n) // P) - len(r.pages)
            if need > 0:
                req.allocations.add(lease_id=r.lease, num_pages=need)
        for r in plan.admitted:
            req.matches.add(request_id=r.id, packed_token_ids=r.token_bytes(), is_resume=r.resumed,
                            omit_page_hashes=True,
                            namespace=common_pb2.Namespace(adapter=r.adapter, salt=r.salt))
        touched = {op.lease_id for op in req.publishes} | {op.lease_id for op in req.allocations}
        req.renew_lease_ids.extend(r.lease for r in sched.running if r.lease not in touched)
        req.load.CopyFrom(common_pb2.LoadReport(
            waiting_requests=len(sched.waiting) - len(plan.admitted),
            running_requests=len(sched.running),
            queued_prefill_tokens=sum(len(r.prompt) - r.computed for r in sched.running
                                      if r.in_prefill)
            + sum(len(r.prompt) for r in sched.waiting), timestamp=time.time()))

    def send(self, plan: StepPlan) -> pb.StepResponse:
        """Step 3: the cache call; on failure, restores what building the ops changed."""
        try:
            return self.cache.step(plan.req)
        except Exception:
            self.sched.retiring = plan.retiring + self.sched.retiring
            for r, lease_tokens, published in plan.saved:
                r.lease_tokens, r.published = lease_tokens, published
            raise

    # ---- applying the answer -----------------------------------------------------------------

    def apply(self, plan: StepPlan, resp: pb.StepResponse) -> list[tuple[Request, int]]:
        """Step 4; returns the batch to forward."""
        sched, by_lease = self.sched, plan.by_lease
        self.stats.steps += 1
        for res in resp.publishes:
            r = by_lease[res.lease_id]
            for remap in res.remaps:
                r.pages[remap.index] = remap.new_page
        # Checkpoints are stored before the copies run: an L3 write of a page reads its slot.
        for res in resp.checkpoints:
            self.runner.store_checkpoint(by_lease[res.lease_id], res)
        self.tiers.run_copies(resp.copies)
        for r in plan.retiring:
            sched.after_release(r)
        lost = set(resp.expired_lease_ids)
        failed = {res.lease_id for res in resp.allocations if not res.ok}
        for res in resp.allocations:
            if res.ok:
                by_lease[res.lease_id].pages.extend(res.device_pages)
        loaded = self.tiers.load_extensions(list(resp.matches))
        for r, m, pages in zip(plan.admitted, resp.matches, loaded, strict=True):
            self._start(r, m, pages)
        for r in [r for r in sched.running if r.lease in lost]:
            log.warning("event=lease_expired request=%s lease=%s", r.id, r.lease)
            r.lease = None
            sched.preempt(r, released=True)
        for r in [r for r, _ in plan.scheduled if r.lease in failed]:
            sched.preempt(r, released=False)
        return [(r, n) for r, n in plan.scheduled if r.status is Status.RUNNING and r.lease
                and r.lease not in failed]

    def _start(self, r: Request, m: pb.MatchResult, remote: list[PageData]) -> None:
        """Starts a matched request past its cached prefix and the L3 pages `remote` loaded into
        the first of m.remote_pages (the other remote pages are computed like new ones; they
        are the lease's already), with the Mamba state of where it resumes."""
        runner = self.runner
        remote_tokens = len(remote) * self.cfg.page_size
        if not self.sched.start(r, m.lease_id, list(m.device_pages) + list(m.remote_pages),
                                computed=m.cached_tokens + remote_tokens,
                                published=len(m.device_pages)):
            return
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
