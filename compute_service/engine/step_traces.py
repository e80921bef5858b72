"""The engine's OpenTelemetry spans (service_shell.tracing): `cache.Step` for each step that
calls the cache service, and `l3.load` for the L3 pages a step's matches load. A step serves
many requests at once, so its span is a child of the first traced request it names (the one
whose trace a reader follows) and links every other traced one. Requests carry their
`worker.Generate` span context in `Request.trace` (None when tracing is off or the caller sent
none), so a step with no traced request costs one scan of its requests and makes no span."""
from __future__ import annotations

from collections.abc import Iterable

from compute_service.engine.request import Request
from prefixcache.v1 import cache_service_pb2 as pb
from service_shell import tracing

_TRACER = tracing.tracer("prefixcache.compute")


def _traced(requests: Iterable[Request]) -> list:
    seen, out = set(), []
    for r in requests:
        if r.trace is not None and r.id not in seen:
            seen.add(r.id)
            out.append(r.trace)
    return out


def _span(name: str, contexts: list, **attributes):
    links = [tracing.trace.Link(tracing.trace.get_current_span(c).get_span_context())
             for c in contexts[1:]]
    return tracing.start(_TRACER, name, contexts[0], tracing.SpanKind.CLIENT, links,
                         **attributes)


def step_span(req: pb.StepRequest, requests: Iterable[Request]):
    """The span of a Step call about `requests`, or None when none of them is traced."""
    if not tracing.enabled():
        return None
    contexts = _traced(requests)
    if not contexts:
        return None
    return _span("cache.Step", contexts, **{
        "rpc.system": "grpc", "rpc.service": "prefixcache.v1.CacheService", "rpc.method": "Step",
        "prefixcache.matches": len(req.matches), "prefixcache.allocations": len(req.allocations),
        "prefixcache.publishes": len(req.publishes), "prefixcache.releases": len(req.releases),
        "prefixcache.traced_requests": len(contexts)})


def l3_span(admitted: list[Request], matches: list[pb.MatchResult]):
    """The span of loading the matches' L3 extensions, or None: tracing off, no L3 page asked
    for, or no traced request among those asking."""
    if not tracing.enabled():
        return None
    asking = [r for r, m in zip(admitted, matches) if m.remote_page_hashes]
    contexts = _traced(asking)
    if not contexts:
        return None
    return _span("l3.load", contexts, **{
        "prefixcache.pages_asked": sum(len(m.remote_page_hashes) for m in matches)})


def end_l3_span(span, loaded: list[list]) -> None:
    if span is not None:
        span.set_attribute("prefixcache.pages_loaded", sum(len(p) for p in loaded))
        span.end()


def request_attributes(s) -> dict[str, object]:
    """A finished request's RequestStats as attributes of its worker.Generate span: where its
    prompt came from, as its usage.prefixcache says."""
    return {"prefixcache.worker": s.worker, "prefixcache.finish_reason":
            s.finish_reason.value if s.finish_reason is not None else None,
            "prefixcache.cached_tokens_device": s.cached_tokens_device,
            "prefixcache.cached_tokens_host": s.cached_tokens_host,
            "prefixcache.cached_tokens_remote": s.cached_tokens_remote,
            "prefixcache.computed_prompt_tokens": s.computed_prompt_tokens,
            "prefixcache.output_tokens": s.output_tokens, "prefixcache.ttft_s": s.ttft_s}
