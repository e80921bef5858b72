"""Answering a completion or chat completion request once its prompts are built (the routes in
gateway/http/routes/): one worker call per choice (`n` samples of each prompt, opened together
so they run as twins on one worker, each with `seed + i` when a seed is given), then the JSON
body or the SSE stream, with OpenAI's usage (app.py's docstring).

A request's `cache_salt` runs it in its own namespace within its tenant's
(`Tenant.with_cache_salt`). An omitted `temperature` is vLLM's default: the model's
generation_config.json (the workers apply it when the field is unset), else 1.0."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import grpc
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from gateway.core.proxy import GenerateProxy, ProxyError
from gateway.core.tenants import Tenant
from gateway.http import schemas
from gateway.http.errors import ApiError, bad_request
from gateway.http.bad_words import bad_word_ids
from gateway.http.choices import Choices
from gateway.http.generation import ClientGone, Generation, Job
from gateway.http.logprobs import TokenNames
from gateway.http.streaming import sse_events
from gateway.http.structured import Structured, http_field
from gateway.http.tools import ToolPlan
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.limits import name_too_long


async def generate(body: schemas.CompletionRequest | schemas.ChatCompletionRequest,
                   prompts: list[pb.GenerateRequest], max_tokens: int | None,
                   request: Request, who: Tenant, rid: str, chat: bool,
                   proxy: GenerateProxy, limiter: anyio.CapacityLimiter,
                   fingerprint: str | None = None, echo: list[str] | None = None,
                   constraint: Structured | None = None,
                   tool_plan: ToolPlan | None = None,
                   answered: Callable[[Generation], None] | None = None) -> Response:
    """The response to `body`, whose prompts are `prompts` (each a GenerateRequest with its
    prompt and adapter set); `rid` names the response and, with the choice's index, each call.
    `echo`: each prompt's text, put before its choices' text (completions' `echo`).
    `constraint`: the output's structured-output constraint (every choice's); `tool_plan`: how
    the choices' text becomes tool calls (gateway/http/tools.py). `answered`: called with the
    generation once every choice has ended, streamed or whole (token-exact turns, turns.py)."""
    who = who.with_cache_salt(body.cache_salt)
    temperature = default_temperature(proxy)
    words = bad_word_ids(body.bad_words, proxy.tokenizer) if body.bad_words else []
    if body.prompt_cache_key:  # 256 characters may still be more than 256 UTF-8 bytes
        problem = name_too_long(body.prompt_cache_key, "prompt_cache_key")
        if problem is not None:
            raise bad_request("prompt_cache_key", problem)
    jobs = []
    for p, prompt in enumerate(prompts):
        for i in range(body.n):
            req = pb.GenerateRequest()
            req.CopyFrom(prompt)
            index = p * body.n + i
            req.request_id = f"{rid}-{index}"
            req.prompt_cache_key = body.prompt_cache_key or ""
            req.prompt_cache_retention = body.prompt_cache_retention or ""
            req.sampling.CopyFrom(sampling(body, max_tokens, i, temperature))
            for ids in words:
                req.sampling.bad_words.add(ids=ids)
            if constraint is not None:
                req.sampling.structured_output.CopyFrom(constraint.message)
            jobs.append(Job(index, p, req, fingerprint))
    if len(jobs) > schemas.MAX_N:  # each choice is a worker call
        raise bad_request("n", f"prompts x n is {len(jobs)} choices; at most "
                               f"{schemas.MAX_N} per request")
    generation = Generation(proxy, who, jobs, body.stop_strings(), limiter,
                            trace=getattr(request.state, "trace", None))
    request.state.usage = generation.usage  # the access-log line's tokens (request_log.py)
    model = body.model or proxy.fleet.model_id or ""
    shape = Choices(chat, body.logprobs_wanted(), TokenNames(proxy.tokenizer.current()), echo,
                    tool_plan)
    salted = body.cache_salt is not None
    try:
        await generation.open(disconnected(request), peek=body.stream)
        if body.stream:
            events = sse_events(generation, shape, rid, int(time.time()), model,
                                body.include_usage(), lambda: usage(generation, salted))
            if answered is not None:
                events = _then(events, lambda: answered(generation))
            return EventSourceResponse(events, sep="\n", ping=15)
        await generation.collect(disconnected(request))
    except ProxyError as exc:  # a constraint the worker's compiler refused: the request's field
        generation.close()
        named = http_field(exc.message, constraint)
        if named is None or exc.code != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        raise bad_request(*named) from None
    except ClientGone:
        generation.close()
        return Response(status_code=499)
    except BaseException:
        generation.close()
        raise
    generation.close()
    if answered is not None:
        answered(generation)
    choices = [shape.whole(s) for s in generation.samples]
    kind = "chat.completion" if chat else "text_completion"
    return JSONResponse(schemas.envelope(kind, rid, int(time.time()), model, choices,
                                         usage=usage(generation, salted)))


async def _then(events: AsyncIterator[dict[str, str]],
                after: Callable[[], None]) -> AsyncIterator[dict[str, str]]:
    """`events`, then `after()` once they ran to their end (not when the client left)."""
    async for event in events:
        yield event
    after()


def refuse_unsupported(problems: list[tuple[str, str]]) -> None:
    if problems:
        param, message = problems[0]
        raise ApiError(400, f"{param}: {message}", param=param)


def default_temperature(proxy: GenerateProxy) -> float | None:
    """What an omitted temperature is sent as: None (unset: the workers apply the model's
    generation_config.json temperature) when the model has one, else vLLM's 1.0."""
    info = proxy.fleet.info
    if info is not None and info.sampling_defaults.HasField("temperature"):
        return None
    return 1.0


def sampling(body: schemas.CompletionRequest | schemas.ChatCompletionRequest,
             max_tokens: int | None, sample: int,
             temperature: float | None = None) -> pb.SamplingParams:
    """The worker's sampling for choice `sample` of a prompt: fields the client left unset stay
    unset (the worker applies the checkpoint's generation defaults) but an omitted temperature
    is `temperature` when given (default_temperature); seed + i per sample."""
    sp = pb.SamplingParams(max_tokens=max_tokens or 0, min_tokens=body.min_tokens,
                           ignore_eos=body.ignore_eos,
                           stop_token_ids=list(body.stop_token_ids or ()),
                           presence_penalty=body.presence_penalty or 0.0,
                           frequency_penalty=body.frequency_penalty or 0.0,
                           min_p=body.min_p or 0.0,
                           logit_bias=[pb.LogitBias(token_id=int(k), bias=v)
                                       for k, v in (body.logit_bias or {}).items()])
    if body.repetition_penalty is not None:
        sp.repetition_penalty = body.repetition_penalty
    if body.logprobs_wanted() is not None:
        sp.logprobs = body.logprobs_wanted()
    if body.temperature is not None:
        sp.temperature = body.temperature
    elif temperature is not None:
        sp.temperature = temperature
    if body.top_p is not None:
        sp.top_p = body.top_p
    if body.top_k is not None:
        sp.top_k = max(0, body.top_k)  # vLLM's -1 = off is the worker's 0
    if body.seed is not None:
        sp.seed = (body.seed + sample) % 2**64
    return sp


def usage(generation: Generation, salted: bool = False) -> dict[str, Any]:
    """`usage.prefixcache.cache_salt`: whether the request ran under its own cache_salt."""
    prompt, completion, cached, ext = generation.usage()
    ext["cache_salt"] = salted
    return schemas.usage(prompt, completion, cached, ext)


def disconnected(request: Request):
    """Completes when the client disconnects (the body is already read, so the next ASGI
    message is the disconnect)."""
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    return wait()
