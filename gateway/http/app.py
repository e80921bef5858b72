"""The OpenAI-compatible HTTP API of the gateway (FastAPI): `POST /v1/completions`,
`POST /v1/chat/completions`, `GET /v1/models`, and `GET /health` (200 when the gateway is
ready, 503 otherwise, for load balancers that speak HTTP only); vLLM's `POST /tokenize`,
`POST /detokenize`, `GET /version`, `GET|POST /ping` and `GET /metrics` (routes/).

Every generation goes through the same core as a gRPC Generate (`GenerateProxy.open`): the same
tenants and salts (`Authorization: Bearer TOKEN`, or the anonymous tenant where the gateway
allows it), the same routing, retries, load accounting and drain. A request becomes one worker
call per choice: `n` samples of each prompt, opened together so they run as twins on one
worker, each with `seed + i` when a seed is given. `model` names the base model or a loaded LoRA
adapter (the call then runs in that adapter's namespace, GenerateRequest.adapter).

Chat prompts are rendered with the model's chat template by the gateway's tokenizer (the one
the workers use), so the gateway routes on exactly the ids the worker computes.

`usage` is OpenAI's (the prompt counted once per prompt, completion tokens summed over the
choices, as vLLM counts them) with `prompt_tokens_details.cached_tokens` = the prompt tokens
the request did not compute (generation.Generation.usage), plus an extension object
`usage.prefixcache`: `cached_tokens_device`, `cached_tokens_host`, `cached_tokens_remote`,
`shared_tokens_in_flight`, `computed_prompt_tokens` (GenerateStats, summed over the choices),
`worker` (the worker(s) that ran them), `route_reason` (why the router chose it), `cache_salt`
(whether the request ran under its own vLLM cache_salt) and, with several choices, `choices`:
the same per choice.

The routes are `APIRouter`s, one module per family (gateway/http/routes/), over dependencies
(gateway/http/deps.py) read from the `HttpCore` this app carries; `create_app` assembles them.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import prometheus_client
from fastapi import FastAPI

from gateway.core.proxy import GenerateProxy
from gateway.core.router import Router
from gateway.http import errors
from gateway.http.body_limit import BodyLimit
from gateway.http.deps import HttpCore
from gateway.http.limits import RateLimit, TenantLimiter, TenantLimits, throttled_counter
from gateway.http.models import ModelCatalog
from gateway.http.request_log import RequestLog
from gateway.http.routes import ROUTERS
from gateway.http.turns import TurnMemory, TurnMemoryConfig


def create_app(proxy: GenerateProxy, router: Router, ready: Callable[[], bool],
               max_streams: int = 512, max_body_bytes: int = 64 << 20,
               tenant_limits: TenantLimits | None = None,
               registry: prometheus_client.CollectorRegistry | None = None,
               access_log: bool = True,
               turn_memory: TurnMemoryConfig | None = None) -> FastAPI:
    """The app over a gateway's proxy and router; `ready()` answers /health. A request body
    over `max_body_bytes` is refused unread (413, body_limit.py); a tenant past its limits
    (`tenant_limits`, overridden per tenant by the tenants file) is answered 429 before that
    (limits.py), counted in `registry`. Every request gets an X-Request-Id, a span when
    tracing is on, and with `access_log` one access-log line (request_log.py). `turn_memory`:
    token-exact chat turns (turns.py), off when None."""
    app = FastAPI(title="prefixcache gateway", docs_url=None, redoc_url=None,
                  openapi_url=None)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # before any parsing
    limiter = TenantLimiter(tenant_limits or TenantLimits(), proxy.tenants.limits)
    app.state.tenant_limiter = limiter
    app.add_middleware(RateLimit, tenants=proxy.tenants, limiter=limiter,
                       throttled=throttled_counter(registry))
    app.add_middleware(RequestLog, access_log=access_log)  # outermost: sees a 429 too
    # Blocking gRPC reads run in threads; each open stream may hold one.
    limiter = anyio.CapacityLimiter(max_streams + 16)
    app.state.registry = registry  # GET /metrics (routes/service.py)
    app.state.core = HttpCore(proxy, ready, ModelCatalog(router, proxy.fleet, limiter), limiter,
                              created=int(time.time()),
                              turns=TurnMemory(turn_memory or TurnMemoryConfig()))
    for routes in ROUTERS:
        app.include_router(routes)
    return app
