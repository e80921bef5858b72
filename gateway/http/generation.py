"""One HTTP request's worker calls: N samples of each prompt (the choices), read concurrently
without blocking the event loop, cut at stop strings, and their usage.

Invariants and why:
- All of a request's calls are opened back to back in one worker thread (`open`), before any is
  read: routed one after the other under the routing lock, the samples of one prompt go to the
  worker the policy's recent-pages memory sends the first one to, and reach it together, so it
  runs them as twins (the prompt computed once, the twins' first tokens from its logits).
- A blocking gRPC read never runs on the event loop: each `next()` runs in anyio's thread pool,
  under a limiter sized to the gateway's stream limit. Reads of different samples are merged
  with asyncio.wait as they complete, so one slow sample never holds the others back.
- A stop string ends its sample at once for the client (finish_reason "stop"); the worker call
  is then aborted by request id rather than cancelled, so its stream still ends with the
  GenerateStats the usage is computed from (a cancelled call would end without them).
- `close()` cancels and releases every call still running (a client that left, an error, the
  end of the request): no worker keeps generating for nobody.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio import to_thread

from gateway.core.proxy import GenerateProxy, ProxiedStream
from gateway.core.tenants import Tenant
from gateway.http.schemas import FINISH_REASONS
from gateway.http.streaming import StopMatcher
from prefixcache.v1 import compute_service_pb2 as pb


class ClientGone(Exception):
    """The HTTP client disconnected; nothing is left to answer."""


@dataclass(slots=True)
class Job:
    """One choice: which prompt of the batch it samples, and its worker request."""
    index: int
    prompt: int
    request: pb.GenerateRequest
    # The tokenizer a worker needs for these ids (a chat rendered by the gateway's); None: as
    # the request's prompt says (GenerateProxy.prepare).
    tokenizer_fingerprint: str | None = None


@dataclass(slots=True, eq=False)
class Sample:
    job: Job
    stop: StopMatcher
    stream: ProxiedStream | None = None
    text: list[str] = field(default_factory=list)
    tokens: int = 0  # output tokens up to the cut (the client's completion tokens)
    # The ids of those tokens (the message that reached a stop string's cut included), for
    # token-exact turns (turns.py checks they decode to `text`).
    ids: list[int] = field(default_factory=list)
    finish: str | None = None
    stats: pb.GenerateStats | None = None
    aborting: bool = False
    # The first message, read by `open(peek=True)` and not yet consumed.
    first: pb.GenerateResponse | None = None
    # (token id, its logprobs) of every token up to the cut, when the request asked for them;
    # `fresh`: those of the last message fed (what a streamed chunk carries).
    logprobs: list[tuple[int, pb.TokenLogprobs]] = field(default_factory=list)
    fresh: list[tuple[int, pb.TokenLogprobs]] = field(default_factory=list)

    @property
    def index(self) -> int:
        return self.job.index

    def feed(self, msg: pb.GenerateResponse) -> tuple[str, bool]:
        """(text the client may see now, whether this message finished the choice)."""
        if msg.HasField("stats"):
            self.stats = msg.stats
        if self.finish is not None:  # cut at a stop string: the rest is the abort's tail
            self.fresh = []
            return "", False
        self.tokens += len(msg.token_ids)
        self.ids += msg.token_ids
        self.fresh = list(zip(msg.token_ids, msg.logprobs))
        self.logprobs += self.fresh
        delta = self.stop.feed(msg.text)
        if self.stop.matched:
            self.finish = "stop"
        elif msg.HasField("stats"):
            delta += self.stop.flush()
            self.finish = FINISH_REASONS.get(msg.stats.finish_reason, "stop")
        if delta:
            self.text.append(delta)
        return delta, self.finish is not None


def _next(stream: ProxiedStream) -> pb.GenerateResponse | None:
    return next(stream, None)


class Generation:
    def __init__(self, proxy: GenerateProxy, tenant: Tenant, jobs: list[Job],
                 stops: list[str], limiter: anyio.CapacityLimiter, trace=None):
        self._proxy, self._tenant, self._limiter = proxy, tenant, limiter
        self._trace = trace  # the gateway.http span's context (request_log.py)
        self.samples = [Sample(job, StopMatcher(stops)) for job in jobs]

    async def open(self, disconnected: Awaitable[Any] | None = None, peek: bool = False) -> None:
        """Starts every worker call (see the module docstring); with `peek`, also waits for
        each call's first message, so that a failure before the first token (no worker, load
        shed, a bad request) is still an HTTP status rather than an error inside a stream.
        ProxyError when a call is refused or fails (the others are closed); ClientGone."""
        await self._run(to_thread.run_sync(self._open_all, peek, limiter=self._limiter,
                                           abandon_on_cancel=True), disconnected)

    def _open_all(self, peek: bool) -> None:
        try:
            for s in self.samples:
                s.stream = self._proxy.open(s.job.request, self._tenant,
                                            tokenizer_fingerprint=s.job.tokenizer_fingerprint,
                                            trace=self._trace)
            for s in self.samples if peek else ():
                s.first = _next(s.stream)
        except BaseException:
            self.close()
            raise

    def prompt_tokens(self) -> list[int]:
        """Tokens of each prompt of the batch (as the proxy tokenized it)."""
        out: dict[int, int] = {}
        for s in self.samples:
            if s.stream is not None:
                out.setdefault(s.job.prompt, len(s.stream.prompt_ids))
        return [out.get(p, 0) for p in range(max(out, default=-1) + 1)]

    async def events(self, disconnected: Awaitable[Any] | None = None
                     ) -> AsyncIterator[tuple[Sample, str, bool]]:
        """(sample, visible text delta, finished now) as the workers' messages arrive; ends when
        every call ended. ProxyError as the proxy raises it; ClientGone when `disconnected`
        completes first."""
        reads: dict[asyncio.Future, Sample] = {}
        watch = asyncio.ensure_future(disconnected) if disconnected is not None else None

        def read(sample: Sample) -> None:
            reads[asyncio.ensure_future(self._read(sample))] = sample

        for s in self.samples:
            read(s)
        try:
            while reads:
                done, _ = await asyncio.wait([*reads, *([watch] if watch else [])],
                                             return_when=asyncio.FIRST_COMPLETED)
                if watch in done:
                    raise ClientGone()
                for fut in done:
                    sample = reads.pop(fut)
                    msg = fut.result()
                    if msg is None:
                        continue
                    delta, finished = sample.feed(msg)
                    if finished and not msg.HasField("stats") and not sample.aborting:
                        sample.aborting = True
                        await to_thread.run_sync(sample.stream.abort, limiter=self._limiter)
                    read(sample)
                    yield sample, delta, finished
        finally:
            for fut in [*reads, *([watch] if watch else [])]:
                fut.cancel()

    async def _read(self, sample: Sample) -> pb.GenerateResponse | None:
        if sample.first is not None:
            first, sample.first = sample.first, None
            return first
        return await to_thread.run_sync(_next, sample.stream, limiter=self._limiter,
                                        abandon_on_cancel=True)

    async def collect(self, disconnected: Awaitable[Any] | None = None) -> None:
        """Reads every call to its end (the non-streaming answer)."""
        async for _ in self.events(disconnected):
            pass

    async def _run(self, work: Awaitable[Any], disconnected: Awaitable[Any] | None) -> Any:
        if disconnected is None:
            return await work
        task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected)
        try:
            done, _ = await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                raise ClientGone()
            return task.result()
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()

    def close(self) -> None:
        for s in self.samples:
            if s.stream is not None:
                s.stream.close()

    # ----- usage ------------------------------------------------------------------------------

    def usage(self) -> tuple[int, int, int, dict[str, Any]]:
        """(prompt tokens, completion tokens, cached tokens, the `prefixcache` extension).

        As vLLM counts them: each prompt once however many samples it has, completion tokens
        summed over the samples (up to a stop string's cut). cached_tokens: the prompt tokens
        the request did not compute, per prompt `prompt_tokens - computed_prompt_tokens` of its
        sample that computed most (its twins recompute at most the last partial page), so with
        one sample it is what GenerateStats say: device + host + remote hits + shared in flight.
        """
        completion = sum(s.tokens for s in self.samples)
        prompts, cached = self.prompt_tokens(), 0
        for p, total in enumerate(prompts):
            stats = [s.stats for s in self.samples if s.job.prompt == p and s.stats is not None]
            if stats:
                cached += max(0, total - max(st.computed_prompt_tokens for st in stats))
        ext = extension([s.stats for s in self.samples if s.stats is not None],
                        [s.stream.route_reason for s in self.samples if s.stream is not None])
        if len(self.samples) > 1:
            ext["choices"] = [{"index": s.index, **extension(
                [s.stats] if s.stats else [], [s.stream.route_reason] if s.stream else [])}
                for s in self.samples]
        return sum(prompts), completion, cached, ext


_STAT_FIELDS = ("cached_tokens_device", "cached_tokens_host", "cached_tokens_remote",
                "shared_tokens_in_flight", "computed_prompt_tokens")


def extension(stats: list[pb.GenerateStats], reasons: list[str]) -> dict[str, Any]:
    """The `usage.prefixcache` object: GenerateStats' prompt accounting summed over the
    samples, the worker(s) that ran them, and why the router chose it (the first sample's)."""
    out: dict[str, Any] = {f: sum(getattr(st, f) for st in stats) for f in _STAT_FIELDS}
    workers = list(dict.fromkeys(st.worker for st in stats))
    out["worker"] = ",".join(workers)
    out["route_reason"] = reasons[0] if reasons else ""
    return out
