"""vLLM's service endpoints on the API port: `GET /version` (this package's version, in vLLM's
`{"version": ...}`), `GET|POST /ping` (SageMaker's health check: /health's answer) and
`GET /metrics` (the gateway's Prometheus metrics, the same registry as --metrics-port serves,
for scrapers that only see the API port). None needs a tenant, as /health does not."""
from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

import prometheus_client
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from gateway.http import deps
from gateway.http.routes.health import health

router = APIRouter()


def version() -> str:
    try:
        return metadata.version("prefixcache")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


@router.get("/version")
async def show_version() -> JSONResponse:
    return JSONResponse({"version": version()})


@router.get("/ping")
@router.post("/ping")
async def ping(ready: Callable[[], bool] = Depends(deps.readiness)) -> JSONResponse:
    return await health(ready)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = getattr(request.app.state, "registry", None) or prometheus_client.REGISTRY
    return Response(prometheus_client.generate_latest(registry),
                    media_type=prometheus_client.CONTENT_TYPE_LATEST)
