"""The models the HTTP API serves: the fleet's base model and every LoRA adapter a worker has
loaded, each a model of its own (as vLLM lists them), refreshed from the workers' GetModelInfo.

Adapters are loaded and unloaded on the workers at runtime, so the list is asked of every
routed worker again once it is `ttl_s` old, and at once (at most every `min_refresh_s`) when a
request names a model not in it (waiting out the rest of `min_refresh_s` when the last refresh
is younger): a client that just loaded an adapter can use it at once, and a flood of unknown
names costs one round of calls per `min_refresh_s`. A worker
that does not answer keeps the adapters it last reported.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import anyio
from anyio import to_thread

from gateway.core.router import Router
from gateway.core.workers import Fleet
from gateway.http.errors import ApiError
from prefixcache_client.compute import ComputeClientError
from prefixcache_client.limits import name_too_long, quote_untrusted


@dataclass(frozen=True, slots=True)
class Models:
    base: str
    adapters: tuple[str, ...]
    max_model_len: int


class ModelCatalog:
    def __init__(self, router: Router, fleet: Fleet, limiter: anyio.CapacityLimiter,
                 ttl_s: float = 2.0, min_refresh_s: float = 0.5, rpc_timeout_s: float = 2.0):
        self._router, self._fleet, self._limiter = router, fleet, limiter
        self._ttl_s, self._min_refresh_s, self._rpc_timeout_s = ttl_s, min_refresh_s, rpc_timeout_s
        self._adapters: dict[str, tuple[str, ...]] = {}  # worker -> its adapters
        self._refreshed = float("-inf")
        self._lock = threading.Lock()

    async def models(self, force: bool = False) -> Models:
        """503 before any worker is known. `force`: the list as the workers have it now; when
        it was refreshed under `min_refresh_s` ago, after waiting out the rest of that time
        (an adapter loaded just after a refresh is found, not refused), unless another call
        refreshed it meanwhile."""
        age = time.monotonic() - self._refreshed
        refresh = age > self._ttl_s or (force and age > self._min_refresh_s)
        if force and not refresh:
            seen = self._refreshed
            await anyio.sleep(self._min_refresh_s - age)
            # Not by age again: the event loop's timer may wake a little early.
            refresh = self._refreshed == seen
        if refresh:
            await to_thread.run_sync(self._refresh, limiter=self._limiter)
        base = self._fleet.model_id
        if base is None:
            raise ApiError(503, "no worker is known yet; retry later",
                           "service_unavailable_error")
        with self._lock:
            adapters = sorted({a for names in self._adapters.values() for a in names})
        return Models(base, tuple(adapters), self._router.max_context_tokens())

    async def resolve(self, model: str | None) -> tuple[str, Models]:
        """The adapter a request's `model` names ("" = the base model; None means the base
        model too, as vLLM takes it); 404 naming the models there are otherwise, 400 for a
        name over prefixcache_client.limits' MAX_NAME_BYTES (the worker's limit)."""
        if model is not None:  # bounded before anything looks it up, logs or echoes it
            problem = name_too_long(model, "model")
            if problem is not None:
                raise ApiError(400, problem, "invalid_request_error", "model")
        models = await self.models()
        if model is None or model == models.base:
            return "", models
        if model not in models.adapters:
            models = await self.models(force=True)
        if model in models.adapters:
            return model, models
        known = ", ".join([models.base, *models.adapters])
        raise ApiError(404, f"model: {quote_untrusted(model)} does not exist; this gateway serves "
                       f"{known}",
                       "invalid_request_error", "model", "model_not_found")

    def _refresh(self) -> None:
        names = self._router.names()
        found: dict[str, tuple[str, ...]] = {}
        for name in names:
            worker = self._router.get(name)
            if worker is None:
                continue
            found[name] = self._adapters.get(name, tuple(worker.info.adapters))
            try:
                info = worker.client.model_info(timeout_s=self._rpc_timeout_s)
            except (ComputeClientError, ValueError):  # ValueError: its channel just closed
                continue
            found[name] = tuple(info.adapters)
        with self._lock:
            self._adapters = found
            self._refreshed = time.monotonic()
