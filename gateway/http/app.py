"""The OpenAI-compatible HTTP API of the gateway (FastAPI): `POST /v1/completions`,
`POST /v1/chat/completions`, `GET /v1/models`, and `GET /health` (200 when the gateway is
ready, 503 otherwise, for load balancers that speak HTTP only).

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
`worker` (the worker(s) that ran them), `route_reason` (why the router chose it) and, with
several choices, `choices`: the same per choice.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio
import grpc
from anyio import to_thread
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from gateway.core.proxy import GenerateProxy, ProxyError
from gateway.core.request_checks import check_request, check_text_size
from gateway.core.router import Router
from gateway.core.tenants import AUTH_METADATA_KEY, AuthError, Tenant
from gateway.http import errors, schemas
from gateway.http.body_limit import BodyLimit
from gateway.http.errors import ApiError, bad_request, from_proxy
from gateway.http.generation import ClientGone, Generation, Job
from gateway.http.models import ModelCatalog
from gateway.http.streaming import sse_events
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.tokenizer import NoChatTemplate

OWNER = "prefixcache"


def create_app(proxy: GenerateProxy, router: Router, ready: Callable[[], bool],
               max_streams: int = 512, max_body_bytes: int = 64 << 20) -> FastAPI:
    """The app over a gateway's proxy and router; `ready()` answers /health. A request body
    over `max_body_bytes` is refused unread (413, body_limit.py)."""
    app = FastAPI(title="prefixcache gateway", docs_url=None, redoc_url=None,
                  openapi_url=None)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # outermost: before any parsing
    # Blocking gRPC reads run in threads; each open stream may hold one.
    limiter = anyio.CapacityLimiter(max_streams + 16)
    catalog = ModelCatalog(router, proxy.fleet, limiter)
    created = int(time.time())

    async def tenant(request: Request) -> Tenant:
        values = request.headers.getlist(AUTH_METADATA_KEY)
        try:
            return proxy.tenants.authenticate([(AUTH_METADATA_KEY, v) for v in values])
        except AuthError as exc:
            raise ApiError(401, str(exc), "authentication_error", None,
                           "invalid_api_key") from None

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = ready()
        return JSONResponse({"status": "ready" if ok else "not ready"},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def list_models(_: Tenant = Depends(tenant)) -> dict[str, Any]:
        models = await catalog.models()
        cards = [schemas.model_card(models.base, created, OWNER, models.max_model_len)]
        cards += [schemas.model_card(a, created, OWNER, models.max_model_len, models.base)
                  for a in models.adapters]
        return {"object": "list", "data": cards}

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request,
                          who: Tenant = Depends(tenant)) -> Response:
        _refuse_unsupported(body.unsupported())
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
        return await _generate(body, requests, body.max_tokens, request, who, rid,
                               chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request,
                               who: Tenant = Depends(tenant)) -> Response:
        _refuse_unsupported(body.unsupported())
        adapter, models = await catalog.resolve(body.model)
        # The messages' text bounded by the context before the template renders it.
        check_text_size("".join(m.text() for m in body.messages), proxy.fleet, "messages")
        ids, fingerprint = await to_thread.run_sync(_chat_ids, proxy, body, limiter=limiter)
        max_tokens = body.token_limit()
        if max_tokens is None:  # OpenAI's default: whatever the context leaves
            max_tokens = models.max_model_len - len(ids)
            if max_tokens < 1:
                raise bad_request("messages", f"the prompt has {len(ids)} tokens and the "
                                  f"model's context is {models.max_model_len}")
        req = pb.GenerateRequest(adapter=adapter)
        req.token_ids.ids.extend(ids)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await _generate(body, [req], max_tokens, request, who, rid, chat=True,
                               fingerprint=fingerprint)

    async def _generate(body: schemas.CompletionRequest | schemas.ChatCompletionRequest,
                        prompts: list[pb.GenerateRequest], max_tokens: int | None,
                        request: Request, who: Tenant, rid: str, chat: bool,
                        fingerprint: str | None = None) -> Response:
        jobs = []
        for p, prompt in enumerate(prompts):
            for i in range(body.n):
                req = pb.GenerateRequest()
                req.CopyFrom(prompt)
                index = p * body.n + i
                req.request_id = f"{rid}-{index}"
                req.sampling.CopyFrom(_sampling(body, max_tokens, i))
                jobs.append(Job(index, p, req, fingerprint))
        if len(jobs) > schemas.MAX_N:  # each choice is a worker call
            raise bad_request("n", f"prompts x n is {len(jobs)} choices; at most "
                                   f"{schemas.MAX_N} per request")
        generation = Generation(proxy, who, jobs, body.stop_strings(), limiter)
        model = body.model or proxy.fleet.model_id or ""
        try:
            await generation.open(_disconnected(request), peek=body.stream)
            if body.stream:
                events = sse_events(generation, chat, rid, int(time.time()), model,
                                    body.include_usage(), lambda: _usage(generation))
                return EventSourceResponse(events, sep="\n", ping=15)
            await generation.collect(_disconnected(request))
        except ClientGone:
            generation.close()
            return Response(status_code=499)
        except BaseException:
            generation.close()
            raise
        generation.close()
        make = schemas.chat_choice if chat else schemas.completion_choice
        choices = [make(s.index, "".join(s.text), s.finish) for s in generation.samples]
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse(schemas.envelope(kind, rid, int(time.time()), model, choices,
                                             usage=_usage(generation)))

    return app


def _refuse_unsupported(problems: list[tuple[str, str]]) -> None:
    if problems:
        param, message = problems[0]
        raise ApiError(400, f"{param}: {message}", param=param)


def _sampling(body: schemas.CompletionRequest | schemas.ChatCompletionRequest,
              max_tokens: int | None, sample: int) -> pb.SamplingParams:
    """The worker's sampling for choice `sample` of a prompt: fields the client left unset stay
    unset (the worker applies the checkpoint's generation defaults); seed + i per sample."""
    sp = pb.SamplingParams(max_tokens=max_tokens or 0, min_tokens=body.min_tokens,
                           ignore_eos=body.ignore_eos,
                           stop_token_ids=list(body.stop_token_ids or ()))
    if body.temperature is not None:
        sp.temperature = body.temperature
    if body.top_p is not None:
        sp.top_p = body.top_p
    if body.top_k is not None:
        sp.top_k = max(0, body.top_k)  # vLLM's -1 = off is the worker's 0
    if body.seed is not None:
        sp.seed = (body.seed + sample) % 2**64
    return sp


def _chat_ids(proxy: GenerateProxy,
              body: schemas.ChatCompletionRequest) -> tuple[list[int], str]:
    """The prompt ids of a chat, rendered with the chat template of the tokenizer the workers
    use (gateway/core/tokenize.py's `chat_prompt_ids`), and that tokenizer's fingerprint (only
    workers with it may run these ids). 400 naming `messages` when the model has no template
    or the template fails on these messages; 503 while the gateway knows no tokenizer yet."""
    tokenizer = proxy.tokenizer
    try:
        ids = tokenizer.chat_prompt_ids(body.chat(), body.add_generation_prompt)
    except NoChatTemplate:
        raise bad_request("messages", "this model has no chat template; send the prompt as "
                                      "text or token ids to /v1/completions") from None
    except ValueError as exc:  # TokenizerUnavailable (with its status), ChatTemplateError
        code = getattr(exc, "code", grpc.StatusCode.INVALID_ARGUMENT)
        message = str(exc).removeprefix("messages: ")
        raise from_proxy(ProxyError(code, f"messages: {message}")) from None
    if not ids:
        raise bad_request("messages", "the chat template rendered an empty prompt")
    return list(ids), tokenizer.fingerprint


def _usage(generation: Generation) -> dict[str, Any]:
    prompt, completion, cached, ext = generation.usage()
    return schemas.usage(prompt, completion, cached, ext)


def _disconnected(request: Request):
    """Completes when the client disconnects (the body is already read, so the next ASGI
    message is the disconnect)."""
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    return wait()
