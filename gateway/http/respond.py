"""Answering a completion or chat completion request once its prompts are built (the routes in
gateway/http/routes/): one worker call per choice (`n` samples of each prompt, opened together
so they run as twins on one worker, each with `seed + i` when a seed is given), then the JSON
body or the SSE stream, with OpenAI's usage (app.py's docstring)."""
from __future__ import annotations

import time
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from gateway.core.proxy import GenerateProxy
from gateway.core.tenants import Tenant
from gateway.http import schemas
from gateway.http.errors import ApiError, bad_request
from gateway.http.generation import ClientGone, Generation, Job
from gateway.http.streaming import sse_events
from prefixcache.v1 import compute_service_pb2 as pb


async def generate(body: schemas.CompletionRequest | schemas.ChatCompletionRequest,
                   prompts: list[pb.GenerateRequest], max_tokens: int | None,
                   request: Request, who: Tenant, rid: str, chat: bool,
                   proxy: GenerateProxy, limiter: anyio.CapacityLimiter,
                   fingerprint: str | None = None) -> Response:
    """The response to `body`, whose prompts are `prompts` (each a GenerateRequest with its
    prompt and adapter set); `rid` names the response and, with the choice's index, each call."""
    jobs = []
    for p, prompt in enumerate(prompts):
        for i in range(body.n):
            req = pb.GenerateRequest()
            req.CopyFrom(prompt)
            index = p * body.n + i
            req.request_id = f"{rid}-{index}"
            req.sampling.CopyFrom(sampling(body, max_tokens, i))
            jobs.append(Job(index, p, req, fingerprint))
    if len(jobs) > schemas.MAX_N:  # each choice is a worker call
        raise bad_request("n", f"prompts x n is {len(jobs)} choices; at most "
                               f"{schemas.MAX_N} per request")
    generation = Generation(proxy, who, jobs, body.stop_strings(), limiter,
                            trace=getattr(request.state, "trace", None))
    request.state.usage = generation.usage  # the access-log line's tokens (request_log.py)
    model = body.model or proxy.fleet.model_id or ""
    try:
        await generation.open(disconnected(request), peek=body.stream)
        if body.stream:
            events = sse_events(generation, chat, rid, int(time.time()), model,
                                body.include_usage(), lambda: usage(generation))
            return EventSourceResponse(events, sep="\n", ping=15)
        await generation.collect(disconnected(request))
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
                                         usage=usage(generation)))


def refuse_unsupported(problems: list[tuple[str, str]]) -> None:
    if problems:
        param, message = problems[0]
        raise ApiError(400, f"{param}: {message}", param=param)


def sampling(body: schemas.CompletionRequest | schemas.ChatCompletionRequest,
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


def usage(generation: Generation) -> dict[str, Any]:
    prompt, completion, cached, ext = generation.usage()
    return schemas.usage(prompt, completion, cached, ext)


def disconnected(request: Request):
    """Completes when the client disconnects (the body is already read, so the next ASGI
    message is the disconnect)."""
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    return wait()
