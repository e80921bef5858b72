"""`POST /v1/completions`: one prompt or several, each text (tokenized by the core, as a gRPC
text prompt is) or token ids; `n` choices of each (gateway/http/respond.py)."""
from __future__ import annotations

import uuid

import anyio
from fastapi import APIRouter, Depends, Request, Response

from gateway.core.proxy import GenerateProxy
from gateway.core.request_checks import check_request, check_text_size
from gateway.core.tenants import Tenant
from gateway.http import deps, respond, schemas, structured
from gateway.http.errors import bad_request
from gateway.http.models import ModelCatalog
from prefixcache.v1 import compute_service_pb2 as pb

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: schemas.CompletionRequest, request: Request,
                      who: Tenant = Depends(deps.tenant),
                      proxy: GenerateProxy = Depends(deps.proxy),
                      catalog: ModelCatalog = Depends(deps.catalog),
                      limiter: anyio.CapacityLimiter = Depends(deps.limiter)) -> Response:
    respond.refuse_unsupported(body.unsupported())
    constraint = structured.from_request(body.response_format, body.structured_outputs)
    adapter, _ = await catalog.resolve(body.model)
    prompts = body.prompts()
    if not prompts:
        raise bad_request("prompt", "must not be empty")
    requests = []
    for i, p in enumerate(prompts):
        req = pb.GenerateRequest(adapter=adapter)
        if isinstance(p, str):
            # Bounded by the context before the proxy tokenizes it (request_checks.py).
            check_text_size(p, proxy.fleet, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
            req.text = p  # tokenized by the proxy, as a gRPC text prompt is
        elif not p:
            raise bad_request("prompt" if len(prompts) == 1 else f"prompt[{i}]",
                              "must not be empty")
        else:
            req.token_ids.ids.extend(p)
            check_request(req, proxy.fleet)  # the vocabulary, as RoutePreview checks it
        requests.append(req)
    rid = f"cmpl-{uuid.uuid4().hex}"
    return await respond.generate(body, requests, body.max_tokens, request, who, rid,
                                  chat=False, proxy=proxy, limiter=limiter,
                                  constraint=constraint)
