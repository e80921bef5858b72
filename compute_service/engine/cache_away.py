"""The engine with its cache service away (Engine's base class, one concern of its own).

A worker whose cache service cannot be reached serves on without it, as an engine with
prefix caching off does (LocalPages: every prompt computed, nothing published, no L3), and
registers a new epoch once it answers again. Before, each failed step slept an exponential
backoff (0.1 s, 0.2 s, ... 2 s) and every request stalled until the service was back
and one more backoff had passed; an idle worker re-registered only with its next request.
A background watch (`_watch_cache`, every cfg.cache_watch_s) notices all three without
waiting for a request: the service unreachable, reachable again, restarted without this
pool. Only the engine thread switches caches (`_follow_cache`, between steps).
"""
from __future__ import annotations

import logging
import threading

import grpc

from compute_service.engine.local_pages import LocalPages
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.cache import CacheUnavailableError

log = logging.getLogger("compute_service.engine")


class CacheAwayMixin:
    """What `Engine` does when its cache service cannot be reached. It uses the engine's
    cache, cfg, planner, scheduler, runner, stats, epoch, _lock, _wakeup, _pool_unknown and
    _reset_pool."""

    def _init_cache_watch(self) -> None:
        # The remote cache while local pages stand in for it (`_serve_locally`), and what the
        # background watch saw (`_watch_cache`).
        self._remote_cache = None
        self._cache_back = False  # the watch reached the cache service again
        self._cache_gone = False  # the watch could not reach it
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def _cache_unreachable(self, exc: BaseException) -> bool:
        """The call did not reach the cache service, or got no answer (it may or may not have
        been applied: Step is not idempotent, so the pool's state there is unknown either way),
        and a watch runs that will notice when it is back (without one, as with an embedded
        cache, the loop re-registers with backoff instead)."""
        return isinstance(exc, CacheUnavailableError) and self._watcher is not None

    def _serve_locally(self, cause: BaseException | None = None) -> None:
        """Engine thread: the cache service is away. Every request holding pages is requeued
        (its pages belong to the pool there) and recomputed from local pages, with no reuse
        until the watch sees the service again (`_rejoin`)."""
        if self._remote_cache is None:
            self._remote_cache = self.cache
            self.stats.cache_away += 1
        local = LocalPages()
        local.register_pool(pb.RegisterPoolRequest(pool_id=self.cfg.pool_id,
                                                   page_size=self.cfg.page_size,
                                                   device_pages=self.cfg.device_pages))
        self._use_cache(local, caching=False)
        self._pool_unknown = False  # a new epoch is registered when the service is back
        with self._lock:
            self._cache_gone = False
        self.scheduler.requeue_all()
        log.warning("event=cache_away running=%d cause=%r: serving without the cache service "
                    "(no reuse) until it answers", len(self.running), str(cause or "watch"))

    def _rejoin(self) -> None:
        """Engine thread: the cache service answers again: register a new epoch and requeue
        what ran on local pages (recomputed from what the new pool holds)."""
        remote, self._remote_cache = self._remote_cache, None
        self._use_cache(remote, caching=True)
        self._reset_pool()  # raises CacheUnavailableError if it is gone again: local again
        self.stats.cache_rejoins += 1
        log.warning("event=cache_rejoined epoch=%d", self.epoch)

    def _use_cache(self, cache, caching: bool) -> None:
        self.cache = self.planner.cache = self.planner.caller.cache = cache
        self.planner.caching = self.scheduler.caching = caching
        self.runner.checkpoints = caching and self.ckpt_slots > 0
        self.planner.reset()

    def _cache_news(self) -> bool:
        """Under _lock: the watch saw something the engine thread must act on."""
        return (self._cache_back if self._remote_cache is not None
                else self._cache_gone or self._pool_unknown)

    def _follow_cache(self) -> None:
        """Engine thread, between steps: acts on what the watch saw."""
        with self._lock:
            back, gone = self._cache_back, self._cache_gone
            self._cache_back = self._cache_gone = False
        if self._remote_cache is not None:
            if back:
                self._rejoin()
        elif gone:
            self._serve_locally()

    def _watch_cache(self) -> None:
        """The background watch: one ListPools every cfg.cache_watch_s."""
        remote = self.cache
        while not self._watch_stop.wait(self.cfg.cache_watch_s):
            away, epoch = self._remote_cache is not None, self.epoch
            try:
                pools = remote.list_pools(timeout_s=max(2.0, self.cfg.cache_watch_s)).pools
            except CacheUnavailableError as exc:  # not reached (a slow answer is not "gone":
                # a step that waits too long for one sends the engine local by itself)
                news = None if away or exc.status != grpc.StatusCode.UNAVAILABLE else "gone"
            except Exception:  # refused (auth), or anything else: not this watch's business
                continue
            else:
                mine = next((p for p in pools if p.pool_id == self.cfg.pool_id), None)
                if away:
                    news = "back"
                elif mine is None or mine.epoch != epoch:
                    news = "lost"  # restarted (or another registration took the pool id)
                else:
                    news = None
            with self._lock:  # the engine thread switched meanwhile: look again first
                if not news or (self._remote_cache is not None) != away or self.epoch != epoch:
                    continue
                if news == "back":
                    self._cache_back = True
                elif news == "gone":
                    self._cache_gone = True
                else:
                    self._pool_unknown = True
                self._wakeup.notify()
