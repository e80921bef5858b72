"""What the gateway checks in a Generate or RoutePreview request before it tokenizes, hashes or
routes it (design.md §8 "Bad input"), so both RPCs (and the HTTP API, which builds the same
requests) refuse what a worker's Generate would refuse, with the worker's message:
- a text prompt too long for the fleet's context, refused by its size before it is tokenized
  (prefixcache_client.limits: the memory of a tokenization is proportional to the text);
- a token id outside the fleet's vocabulary (GetModelInfo.vocab_size of its workers): without
  this RoutePreview previewed requests that Generate refuses;
- sampling floats that are NaN or infinite or out of range (temperature 0 or (0, 100],
  top_p [0, 1]: the workers' bounds, compute_service/engine/sampling.py).
Each failure is a `ProxyError(INVALID_ARGUMENT)` whose message starts with the field."""
from __future__ import annotations

import math

import grpc

from gateway.core.proxy import ProxyError
from gateway.core.workers import Fleet
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.limits import text_too_long

MAX_TEMPERATURE = 100.0


def check_text_size(text: str, fleet: Fleet, field: str = "prompt.text") -> None:
    """The fleet's context is its first worker's (GetModelInfo): the fleet serves one model, and
    the 32x margin of the bound dwarfs any difference between its workers' contexts."""
    context = fleet.info.max_context_tokens if fleet.info is not None else 0
    if context:
        problem = text_too_long(text, context, field)
        if problem is not None:
            raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT, problem)


def check_request(request: pb.GenerateRequest, fleet: Fleet) -> None:
    """The checks of the module docstring; before any worker is known only the floats (the
    caller's prepare then answers UNAVAILABLE)."""
    _check_sampling(request.sampling)
    if request.WhichOneof("prompt") == "text":
        check_text_size(request.text, fleet)
    info = fleet.info
    vocab = info.vocab_size if info is not None else 0
    if not vocab:
        return
    if request.WhichOneof("prompt") == "token_ids":
        bad = next((t for t in request.token_ids.ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"prompt.token_ids: {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in request.sampling.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"sampling.stop_token_ids: {bad} is outside [0, {vocab})")


def _check_sampling(s: pb.SamplingParams) -> None:
    if s.HasField("temperature"):
        t = s.temperature
        if not (math.isfinite(t) and (t == 0 or 0 < t <= MAX_TEMPERATURE)):
            raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"sampling.temperature: must be 0 (greedy) or in (0, "
                             f"{MAX_TEMPERATURE:g}], got {t}")
    if s.HasField("top_p"):
        p = s.top_p
        if not (math.isfinite(p) and 0 <= p <= 1):
            raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"sampling.top_p: must be in [0, 1], got {p}")
