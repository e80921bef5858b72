"""`GET /v1/models`: the fleet's base model and every LoRA adapter a worker has loaded, as
OpenAI model cards (the catalog: gateway/http/models.py); a tenant's call."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gateway.core.tenants import Tenant
from gateway.http import deps, schemas
from gateway.http.models import ModelCatalog

OWNER = "prefixcache"

router = APIRouter()


@router.get("/v1/models")
async def list_models(_: Tenant = Depends(deps.tenant),
                      catalog: ModelCatalog = Depends(deps.catalog),
                      created: int = Depends(deps.created)) -> dict[str, Any]:
    models = await catalog.models()
    cards = [schemas.model_card(models.base, created, OWNER, models.max_model_len)]
    cards += [schemas.model_card(a, created, OWNER, models.max_model_len, models.base)
              for a in models.adapters]
    return {"object": "list", "data": cards}
