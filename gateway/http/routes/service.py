"""vLLM's service endpoints on the API port: `GET /version` (this package's version, in vLLM's
`{"version": ...}`), `GET|POST /ping` (SageMaker's health check: /health's answer) and
`GET /metrics` (the gateway's Prometheus metrics, the same registry as --metrics-port serves,
for scrapers that only see the API port; on a model server, followed by its worker's, vLLM's
names included, as an InferencePool's scrapers expect of a vLLM pod). None needs a tenant, as
/health does not."""
from __future__ import annotations

from collections.abc import Callable
import urllib.request
from importlib import metadata

import prometheus_client
from anyio import to_thread
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
    body = prometheus_client.generate_latest(registry)
    upstream = getattr(request.app.state, "upstream_metrics", "")
    if upstream:  # a model server: its worker's too (vllm:*), as a vLLM pod's /metrics has
        body += await to_thread.run_sync(_scrape, upstream)
    return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)


def _scrape(url: str) -> bytes:
    """The worker's exposition text; a comment saying why when it cannot be read (the
    gateway's own metrics are still served)."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.read()
    except OSError as exc:
        return f"# worker metrics at {url} unavailable: {exc}\n".encode()
