"""The HTTP routes' dependencies (FastAPI `Depends`): what a route needs of the gateway, taken
from the `HttpCore` that `create_app` (app.py) puts on `app.state.core`. A route asks for the
narrowest one it needs, so a test can serve one router (gateway/http/routes/) on a bare FastAPI
app and override just those (`app.dependency_overrides[deps.catalog] = ...`).

All are `async def`: FastAPI runs a plain `def` dependency in its thread pool, and these only
read attributes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from fastapi import Depends, Request

from gateway.core.proxy import GenerateProxy
from gateway.core.tenants import AuthError, Tenant
from gateway.http.errors import ApiError
from gateway.http.models import ModelCatalog
from gateway.http.turns import TurnMemory, TurnMemoryConfig


@dataclass(frozen=True, slots=True)
class HttpCore:
    """The gateway as the HTTP routes see it."""
    # The routing core's Generate path (tenants, fleet and tokenizer included).
    proxy: GenerateProxy
    # Whether the gateway is ready (GET /health).
    ready: Callable[[], bool]
    # The base model and the workers' adapters (GET /v1/models, a request's `model`).
    catalog: ModelCatalog
    # Blocking gRPC reads and tokenizations run in threads under this limiter.
    limiter: anyio.CapacityLimiter
    # The `created` time of the model cards: when the app was built.
    created: int
    # Chat answers' token ids for token-exact turns (turns.py); off unless configured.
    turns: TurnMemory = field(default_factory=lambda: TurnMemory(TurnMemoryConfig()))


async def core(request: Request) -> HttpCore:
    return request.app.state.core


async def proxy(core: HttpCore = Depends(core)) -> GenerateProxy:
    return core.proxy


async def readiness(core: HttpCore = Depends(core)) -> Callable[[], bool]:
    return core.ready


async def catalog(core: HttpCore = Depends(core)) -> ModelCatalog:
    return core.catalog


async def limiter(core: HttpCore = Depends(core)) -> anyio.CapacityLimiter:
    return core.limiter


async def created(core: HttpCore = Depends(core)) -> int:
    return core.created


async def turns(core: HttpCore = Depends(core)) -> TurnMemory:
    return core.turns


async def tenant(request: Request, proxy: GenerateProxy = Depends(proxy)) -> Tenant:
    """The caller's tenant from its `Authorization: Bearer TOKEN` header (the gRPC API's
    metadata, the same tenants), or on a model server the one the data plane forwards
    (gateway/core/dataplane_tenants.py); 401 otherwise."""
    try:
        who = proxy.tenants.authenticate(request.headers.items())
    except AuthError as exc:
        raise ApiError(401, str(exc), "authentication_error", None,
                       "invalid_api_key") from None
    request.state.tenant = who.name  # for the access-log line (request_log.py)
    return who
