"""OpenTelemetry tracing of every service: off by default; on with --tracing (every server's
flag) or the standard OTEL_TRACES_EXPORTER=otlp, exporting spans over OTLP/gRPC to
--otlp-endpoint or the standard OTEL_EXPORTER_OTLP_ENDPOINT (the SDK reads the other OTEL_*
variables itself: headers, timeouts, sampler, resource attributes; OTEL_SDK_DISABLED=true wins).

W3C trace context (`traceparent`, `tracestate`) travels in gRPC metadata and HTTP headers:
`inject` adds it to a call's metadata, `extract` reads it from a request's. A service with
tracing off neither reads nor writes it, and every helper here is then one attribute check, so
the hot paths pay nothing (prefixcache_bench.stack.tracing_overhead measures the on case).

The spans: gateway (`gateway.http` per HTTP request, `gateway.Generate` per gRPC call) ->
`worker.Generate` -> `cache.Step` (one per engine step with a cache call, the worker's side of
the RPC; parent: the first traced request of the step, links to the others) and `l3.load` (L3
pages loaded for admitted requests) -> `cache_service.Step`, the cache service's side of that
call, made only for a call that carries a trace context (`joined`): an untraced Step makes no
span, so idle workers' Steps are no traces.
"""
from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context

from service_shell.config import add_bool_flag, add_flag

log = logging.getLogger(__name__)

_enabled = False


def add_tracing_flags(parser: argparse.ArgumentParser) -> None:
    add_bool_flag(parser, "--tracing", "TRACING",
                  "export OpenTelemetry spans over OTLP/gRPC and propagate W3C trace context",
                  "off, unless OTEL_TRACES_EXPORTER=otlp")
    add_flag(parser, "--otlp-endpoint", "OTLP_ENDPOINT", None,
             "OTLP/gRPC collector for --tracing, e.g. http://otel-collector:4317; default: "
             "OTEL_EXPORTER_OTLP_ENDPOINT, else the SDK's http://localhost:4317")


def wanted(flag: bool | None, environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """--tracing/--no-tracing when given, else the standard variables decide."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if flag is not None:
        return flag
    exporters = environ.get("OTEL_TRACES_EXPORTER", "")
    return "otlp" in [e.strip().lower() for e in exporters.split(",")]


def configure(service: str, args: argparse.Namespace) -> bool:
    """Installs the process's tracer provider (OTLP/gRPC batch export, resource service.name =
    `service` unless OTEL_SERVICE_NAME says otherwise) when tracing is wanted; True if so."""
    if not wanted(args.tracing):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=args.otlp_endpoint) if args.otlp_endpoint \
        else OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    enable()
    log.info("event=tracing_enabled service=%s endpoint=%s", service,
             args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "default"))
    return True


def enable(on: bool = True) -> None:
    """Turns span creation and propagation on for this process (configure does; tests install
    an in-memory exporter on a provider of their own and call this)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(metadata: Sequence[tuple[str, str]] | None = (), ctx: Context | None = None):
    """`metadata` plus the trace context of `ctx` (default: the current one) when on; when off,
    `metadata` itself (None stays None), so the untraced call is the call it always was."""
    if not _enabled:
        return metadata
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return tuple(metadata or ()) + tuple(carrier.items())


def extract(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The caller's trace context from gRPC metadata or HTTP header pairs; None when off."""
    if not _enabled:
        return None
    carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def joined(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The caller's trace context only when it sent one (else None: no span at all). For calls
    that are many and uninteresting alone (the cache service's Steps): a span only as part of a
    traced request, never a root trace per call."""
    ctx = extract(metadata)
    if ctx is None or not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def start(tracer_: trace.Tracer, name: str, parent: Context | None,
          kind: trace.SpanKind = trace.SpanKind.INTERNAL,
          links: Sequence[trace.Link] = (), **attributes) -> trace.Span | None:
    """A span under `parent` (not made current: it may end on another thread); None when off."""
    if not _enabled:
        return None
    return tracer_.start_span(name, context=parent, kind=kind, links=links,
                              attributes={k: v for k, v in attributes.items() if v is not None})


def context_of(span: trace.Span | None) -> Context | None:
    return trace.set_span_in_context(span) if span is not None else None


def attach(ctx: Context | None):
    """Makes `ctx` current on this thread (its token for `detach`), or nothing when None."""
    return otel_context.attach(ctx) if ctx is not None else None


def detach(token) -> None:
    if token is not None:
        otel_context.detach(token)


def annotate(ctx: Context | None, **attributes) -> None:
    """Sets attributes on the span of `ctx` (routing facts learnt after the span started)."""
    if ctx is None:
        return
    span = trace.get_current_span(ctx)
    if span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v not in (None, "")})


SpanKind = trace.SpanKind


def end(span: trace.Span | None) -> None:
    if span is not None:
        span.end()


def fail(ctx: Context | None, code: str, message: str) -> None:
    """Marks the span of `ctx` as failed with the status the caller gets."""
    if ctx is None:
        return
    span = trace.get_current_span(ctx)
    if span.is_recording():
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}: {message}"))
        span.set_attribute("rpc.grpc.status_code", code)
