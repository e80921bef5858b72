"""The engine: continuous batching with chunked prefill over a paged KV cache, driven by the cache
service through at most one batched Step call per engine step. Split as nano-vllm splits it:

- `scheduler.Scheduler`: the queues (waiting, running, retiring), admission, the token budget,
  the sibling rule, twins, preemption and aborts; no tensors, no cache calls.
- `step_planner.StepPlanner`: the step's one `StepRequest` (publishes, checkpoints, releases,
  allocations, matches, renewals), whether and how it is sent (skipped, overlapped with the
  forward, or waited for), its rollback when the call fails, and the application of the
  `StepResponse` (remaps, checkpoints, tier copies, L3 loads, starts, preemptions).
- `model_runner.ModelRunner`: the KV cache and Mamba slots, batch assembly, the forward, sampling.
- `Engine` (here): the public, thread-safe API, the step as a sequence of those parts' calls, and
  the loop thread with its recovery (re-registering the pool under a new epoch).

One step:
1. Build the cache ops: the retiring requests' final publishes, checkpoints and releases, the
   running requests' publishes (design.md lesson 1: during prefill, not at the end); then the
   scheduler picks this step's tokens and admissions, and their allocations and matches follow.
2. Send them: no call when there is nothing to say (most decode steps); a call on the planner's
   caller thread when the forward needs nothing from its answer (it then runs during the
   forward: step_planner, "Overlap"); else one call now, whose answer is applied before the
   forward (step 3). A call that fails is undone and the loop retries (or re-registers: `_loop`).
3. Apply its answer: remapped pages, checkpoints, tier copies, L3 loads, started matches (their
   cached prefix is skipped whole, design.md lesson 9), preemptions.
4. One forward over every scheduled request: each computes `min(remaining, budget)` tokens, where
   remaining = tokens not yet in its KV. A request whose KV catches up with its tokens samples its
   next token (decode is the case remaining == 1). An overlapped call's answer is taken and
   applied (step 3) after the forward, before the sampled tokens are emitted.

Between steps: no cache call is in flight; every lease the engine holds belongs to a request in
`running` or `retiring` (retiring ones are published and released by the next step that calls),
and `Engine._live` holds exactly the requests submitted and not finished, so an id is free again
once its last output was sent. `EngineStats.cache_wait_s` counts the time the engine thread was
blocked on a call's answer, of `step_s` in all.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from prefixcache_client.cache import CacheClient
from prefixcache_client.errors import CacheError, ErrorCode
from prefixcache_client.limits import quote_untrusted
from compute_service.engine.cache_away import CacheAwayMixin
from compute_service.engine.config import EngineConfig, EngineStats
from compute_service.engine.grammar import GrammarEngine
from compute_service.engine.local_pages import LocalPages
from compute_service.engine.model_runner import ModelRunner
from compute_service.engine.request import FinishReason, Output, Request, RequestStats, Status
from compute_service.engine.sampling import SamplingParams
from compute_service.engine.scheduler import Scheduler
from compute_service.engine.step_planner import StepPlanner
from compute_service.model import CausalLM, Tokenizer
from compute_service.tiers import (WRITE_POLICIES, PageLayout, RemoteTier, RemoteTierConfig,
                                   allocate_host_pool)
from compute_service.lora import AdapterNotFoundError, AdapterRegistry, NoFreeSlotError
from compute_service.tiers.mover import TierMover
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from service_shell.retry import STEP_RETRY

log = logging.getLogger("compute_service.engine")


class Engine(CacheAwayMixin):
    """Public API, thread-safe: `submit`, `abort`, adapters, metrics, start/stop/close. The
    engine thread (`_loop`, or the caller of `step` / `run_until_idle`) alone runs steps and
    touches the scheduler's queues; other threads hand it work through `_inbox` and `_aborts`
    under `_lock`. The engine thread holds it only briefly (to take those, or to free a finished
    request's id), never across a step nor while it calls a request's sink."""

    MAX_STEP_FAILURES = 8  # consecutive failed steps before every request is failed

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, cache, cfg: EngineConfig | None = None):
        """`cache` is a CacheCore (embedded) or a CacheClient (remote): both take the same
        RegisterPoolRequest / StepRequest messages. With `cfg.prefix_cache` False it must be
        None: the engine allocates from its own `LocalPages`."""
        cfg = cfg or EngineConfig()
        if not cfg.prefix_cache:
            if cache is not None:
                raise ValueError("cache: prefix_cache=False allocates pages locally; pass None")
            if cfg.host_pages or cfg.l3 is not None:
                raise ValueError("prefix_cache: host pages and L3 hold cached pages; they need "
                                 "prefix caching on")
            cache = LocalPages()
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.cfg = cfg
        mc = model.config
        self.vocab_size = mc.vocab_size
        self.eos = tuple(tokenizer.eos_token_ids)
        self.mamba = bool(mc.mamba_layer_ids)
        self.ckpt_slots = cfg.checkpoint_slots if self.mamba and cfg.prefix_cache else 0
        if cfg.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1 (adapter requests would wait forever), "
                             f"got {cfg.max_loras}")
        if cfg.l3_write_policy not in WRITE_POLICIES:
            raise ValueError(f"l3_write_policy: {cfg.l3_write_policy!r} is not one of "
                             f"{', '.join(WRITE_POLICIES)}")
        if cfg.l3 is None and (cfg.l3_write_policy != "none" or cfg.l3_lookup):
            raise ValueError("l3: an L3 write policy or lookup needs an L3 client (--redis-url)")
        self.stats = EngineStats()
        self.adapters = (AdapterRegistry(model, max_loaded=cfg.max_loaded_adapters,
                                         max_rank=cfg.max_lora_rank)
                         if cfg.max_loaded_adapters else None)
        self.grammar = GrammarEngine(tokenizer, self.vocab_size, self.eos)
        self.runner = ModelRunner(model, cfg, self.adapters, self.stats, self.eos, self.ckpt_slots,
                                  self.grammar)
        self.host_kv = allocate_host_pool(self.kv, cfg.host_pages, pin=model.device.type == "cuda")
        layout = PageLayout.of_model(mc, cfg.page_size, model.dtype)
        self.l3 = (RemoteTier(cfg.l3, cfg.model_id, layout, RemoteTierConfig(
            cfg.l3_write_queue_bytes, cfg.l3_batch_pages)) if cfg.l3 is not None else None)
        self.tiers = TierMover(self.kv, self.host_kv, self.states, cfg.max_running, layout, self.l3)
        self._register()
        self.scheduler = Scheduler(cfg, self.stats, tokenizer, self.eos, self.adapters,
                                   self._forget)
        self.planner = StepPlanner(cfg, cache, self.scheduler, self.runner, self.tiers, self.stats)
        # An engine dropped without close() does not leave its caller thread behind.
        weakref.finalize(self, self.planner.caller.close, False)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._live: dict[str, Request] = {}  # every unfinished request, by id (under _lock)
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._pool_unknown = False  # set when a step failed in a way that may have lost state
        self._init_cache_watch()

    # The parts' state, under the names tests, metrics and benchmarks read.
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    retiring = property(lambda self: self.scheduler.retiring)
    free_slots = property(lambda self: self.scheduler.free_slots)
    kv = property(lambda self: self.runner.kv)
    states = property(lambda self: self.runner.states)

    def _register(self) -> None:
        """Registers the pool under a new epoch (at start, and when the cache service lost it)."""
        cfg = self.cfg
        epoch = time.time_ns()
        self.cache.register_pool(pb.RegisterPoolRequest(
            pool_id=cfg.pool_id, epoch=epoch, page_size=cfg.page_size,
            device_pages=cfg.device_pages, host_pages=cfg.host_pages,
            mamba_slots=self.ckpt_slots, model_id=cfg.model_id, lease_ttl_s=cfg.lease_ttl_s,
            remote_write_policy=WRITE_POLICIES[cfg.l3_write_policy],
            remote_min_hits=cfg.l3_min_hits, remote_lookup=cfg.l3_lookup))
        self.epoch = epoch  # once registered: the cache watch compares it with the service's

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
        """Unloads an adapter and evicts its cache namespace for every tenant (design.md
        lesson 5: pages of running requests are freed when they end, and their weights stay
        until then). Returns (pages removed now, pages deferred)."""
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
               request_id: str = "", adapter: str = "", salt: str = "",
               resume_output: Sequence[int] = (), trace: object | None = None,
               retain_s: float = 0.0) -> Request:
        """Queues a request; raises ValueError naming the bad field. `resume_output`: output
        tokens the caller already has (another worker streamed them, then failed): the request
        goes on after them, as a preempted one does, and streams only what follows. `trace`:
        the caller's span context, which the engine's spans join (engine/step_traces.py).
        `retain_s`: keep its prefix on device this long after it ends (MatchOp.retain_s)."""
        if not prompt:
            raise ValueError("prompt: must not be empty")
        for field, ids in (("prompt.token_ids", prompt), ("resume_output.ids", resume_output)):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{field}: {bad} is outside the vocabulary [0, {self.vocab_size})")
        sampling.validate(self.vocab_size)
        compiled = self.grammar.check(sampling)  # compiled here, not on the engine thread
        if len(resume_output) >= sampling.max_tokens:
            raise ValueError(f"resume_output: {len(resume_output)} tokens already reach "
                             f"max_tokens {sampling.max_tokens}")
        if adapter and adapter not in self.adapter_names():
            raise LookupError(f"adapter: {quote_untrusted(adapter)} is not loaded on this worker")
        if len(salt.encode()) > 256:
            raise ValueError("salt: must be at most 256 UTF-8 bytes")
        limit = self.context_limit
        if len(prompt) + sampling.max_tokens > limit:
            raise ValueError(f"prompt: {len(prompt)} tokens + max_tokens {sampling.max_tokens} exceed "
                             f"this worker's context of {limit} tokens")
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt), sampling, sink,
                      adapter=adapter, salt=salt, trace=trace, retain_s=retain_s)
        for i in range(len(resume_output)):  # the text stream where the other worker left it
            req.output.append(resume_output[i])
            req.text.next(self.tokenizer, req.output)
        if compiled is not None:
            req.matcher = self.grammar.matcher(compiled, req.output)
        if sampling.seed is not None:
            req.generator = torch.Generator(device=self.model.device).manual_seed(sampling.seed)
        req.stats = RequestStats(req.id, self.cfg.pool_id, len(prompt))
        with self._lock:
            if req.id in self._live:
                raise ValueError(f"request_id: {quote_untrusted(req.id)} is already running on "
                                 "this worker")
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

    def _forget(self, request_id: str) -> None:
        """The request finished: its id is free again (Scheduler.finish, before its last output)."""
        with self._lock:
            self._live.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> None:
        """One engine step: new requests and aborts in, at most one batched cache call, one
        forward (see the module docstring)."""
        started = time.perf_counter()
        try:
            self._step()
        finally:
            self.stats.step_s += time.perf_counter() - started

    def _step(self) -> None:
        with self._lock:
            self.scheduler.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        self.scheduler.abort(aborts)
        planner = self.planner
        # 1. The cache ops. Publishes first: the sibling rule reads what they publish.
        plan = planner.publish(self.epoch)
        plan.scheduled, plan.admitted = self.scheduler.schedule()
        planner.allocate_and_match(plan)
        planner.send(plan)  # 2. raises with building the ops undone
        if not plan.overlapped:
            planner.receive(plan)  # 3.
        batch = planner.batch(plan)
        sampled: list = []
        failure: Exception | None = None
        try:
            if batch:  # 4.
                sampled = self.runner.run(batch, self.scheduler.twins)
        finally:
            if plan.overlapped:
                try:
                    planner.receive(plan)  # 3., after the forward
                except Exception as exc:  # the tokens are sampled: emit them, then raise
                    failure = exc
        for r, tok, logprobs in sampled:
            self.scheduler.emit(r, tok, logprobs)
        if failure is not None:
            raise failure

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
        """Stops the loop and the cache caller, then the L3 writer once it has attempted its
        queue."""
        self.stop()
        self.planner.caller.close()
        self.runner.close()
        if self.l3 is not None:
            self.l3.close()

    def start(self) -> None:
        if isinstance(self.cache, CacheClient) and self.cfg.cache_watch_s > 0:
            self._watcher = threading.Thread(target=self._watch_cache, name="cache-watch",
                                             daemon=True)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        if self._watcher is not None:
            self._watcher.start()

    def stop(self) -> None:
        """Stops the loop; requests still queued or running end with ABORT."""
        with self._lock:
            self._stopped = True
            self._wakeup.notify()
        self._watch_stop.set()
        if self._thread:
            self._thread.join(timeout=30)
        if self._watcher is not None and self._watcher.is_alive():
            self._watcher.join(timeout=5)
        self._fail_all()

    def _loop(self) -> None:
        failures = 0
        while True:
            with self._lock:
                while not self.has_work() and not self._stopped and not self._cache_news():
                    self._wakeup.wait()
                if self._stopped:
                    return
            try:
                self._follow_cache()
                if self._pool_unknown:
                    self._reset_pool()
                if self.has_work():
                    self.step()
                failures = 0
            except Exception as exc:  # a failed step must not kill the worker silently
                if self._cache_unreachable(exc):  # serve on without it: no backoff, no failure
                    self._serve_locally(exc)
                    continue
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
                # failures + 1: 0.1 s after the first failure, 0.05 s after _fail_all reset it.
                time.sleep(STEP_RETRY.delay(failures + 1))

    def _reset_pool(self) -> None:
        """Registers a new epoch, then recomputes every running request from what the new pool
        holds (the old leases are gone or will expire)."""
        self._register()
        self.planner.reset()
        self._pool_unknown = False
        self.stats.recoveries += 1
        log.warning("event=pool_reregistered epoch=%d running=%d", self.epoch, len(self.running))
        self.scheduler.requeue_all()

    def _fail_all(self) -> None:
        """Ends every request with ABORT and frees what they held (their leases expire)."""
        self.scheduler.abort_all()
        with self._lock:
            for r in self._inbox:
                r.status = Status.FINISHED
            pending, self._inbox = self._inbox, []
        for r in pending:
            self.scheduler.finish(r, FinishReason.ABORT)
