"""`GET /health`: 200 when the gateway is ready, 503 otherwise, for load balancers that speak
HTTP only (no tenant needed)."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from gateway.http import deps

router = APIRouter()


@router.get("/health")
async def health(ready: Callable[[], bool] = Depends(deps.readiness)) -> JSONResponse:
    ok = ready()
    return JSONResponse({"status": "ready" if ok else "not ready"},
                        status_code=200 if ok else 503)
