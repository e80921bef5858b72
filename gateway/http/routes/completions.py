"""`POST /v1/completions`: one prompt or several, each text (tokenized by the core, as a gRPC
text prompt is) or token ids; `n` choices of each (gateway/http/respond.py)."""
from __future__ import annotations


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
    rid = f"cmpl-{request.state.request_id}"  # X-Request-Id (request_log.py)
    echo = echo_texts(prompts, proxy) if body.echo else None
    return await respond.generate(body, requests, body.max_tokens, request, who, rid,
                                  chat=False, proxy=proxy, limiter=limiter, echo=echo,
                                  constraint=constraint)


def echo_texts(prompts: list[str | list[int]], proxy: GenerateProxy) -> list[str]:
    """The text `echo` puts before each prompt's choices: the prompt as sent, or its ids
    decoded by the workers' tokenizer, as vLLM echoes them."""
    tokenizer = proxy.tokenizer.current()
    if tokenizer is None and any(not isinstance(p, str) for p in prompts):
        raise bad_request("echo", "the gateway knows no tokenizer to decode the prompt's "
                                  "token ids with")
    return [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)
            for p in prompts]
