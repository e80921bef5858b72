"""What the gateway checks in a Generate or RoutePreview request before it tokenizes, hashes or
routes it (design.md §8 "Bad input"), so both RPCs (and the HTTP API, which builds the same
requests) refuse what a worker's Generate would refuse, with the worker's message:
- a text prompt too long for the fleet's context, refused by its size before it is tokenized
  (prefixcache_client.limits: the memory of a tokenization is proportional to the text);
- a token id outside the fleet's vocabulary (GetModelInfo.vocab_size of its workers): without
  this RoutePreview previewed requests that Generate refuses;
- sampling floats that are NaN or infinite or out of range (temperature 0 or (0, 100],
  top_p [0, 1], the penalties, min_p, logit_bias: the workers' bounds,
  compute_service/engine/sampling.py), and more top logprobs than the workers return;
- names, ids and counts over prefixcache_client.limits (the adapter, the request id, stop
  token ids, prompt_cache_key), and a prompt_cache_retention other than "in_memory" or "24h", refused at parse as the worker refuses them: the gateway never routes, hashes,
  logs or forwards a 10 MB adapter name;
- a token-id prompt with no room in the fleet's context (OUT_OF_RANGE, the worker's code):
  RoutePreview previewed a 1M-token prompt that Generate refuses.
Each failure is a `ProxyError(INVALID_ARGUMENT)` whose message starts with the field."""
from __future__ import annotations

import math

import grpc

from gateway.core.proxy import ProxyError
from gateway.core.workers import Fleet
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.limits import (name_too_long, prompt_cache_retention_problem,
                                      request_id_too_long, stop_token_ids_problem,
                                      text_too_long)

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
    check_names(request)
    if request.WhichOneof("prompt") == "text":
        check_text_size(request.text, fleet)
    info = fleet.info
    context = info.max_context_tokens if info is not None else 0
    if context and request.WhichOneof("prompt") == "token_ids" and \
            len(request.token_ids.ids) >= context:
        raise ProxyError(grpc.StatusCode.OUT_OF_RANGE,
                         f"prompt.token_ids: {len(request.token_ids.ids)} tokens leave no room "
                         f"in the fleet's context of {context} tokens")
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
    for i, word in enumerate(request.sampling.bad_words):
        bad = next((t for t in word.ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"sampling.bad_words[{i}].ids: {bad} is outside [0, {vocab})")


def check_names(request: pb.GenerateRequest) -> None:
    """The request's names, ids and counts against prefixcache_client.limits (INVALID_ARGUMENT
    naming the field; the value itself is never echoed)."""
    problem = (name_too_long(request.adapter, "adapter")
               or request_id_too_long(request.request_id)
               or stop_token_ids_problem(len(request.sampling.stop_token_ids))
               or name_too_long(request.prompt_cache_key, "prompt_cache_key")
               or prompt_cache_retention_problem(request.prompt_cache_retention))
    if problem is not None:
        raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT, problem)


def check_request_id(request_id: str) -> None:
    """An Abort's request id (gRPC and the Endpoint Picker), as Generate's is checked."""
    if not request_id:
        raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
    problem = request_id_too_long(request_id)
    if problem is not None:
        raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT, problem)


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
    _check_processing(s)


# field -> (low, high, low inclusive): the workers' bounds (compute_service/engine/sampling.py).
_BOUNDS = {"presence_penalty": (-2.0, 2.0, True), "frequency_penalty": (-2.0, 2.0, True),
           "repetition_penalty": (0.0, 100.0, False), "min_p": (0.0, 1.0, True)}
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS, MAX_BAD_WORD_IDS = 128, 1024


def _check_processing(s: pb.SamplingParams) -> None:
    """The penalties, min_p, logit_bias and logprobs, as the workers check them (NaN fails
    every comparison, so it is out of range too)."""
    def bad(message: str) -> ProxyError:
        return ProxyError(grpc.StatusCode.INVALID_ARGUMENT, message)

    for name, (low, high, closed) in _BOUNDS.items():
        if name == "repetition_penalty" and not s.HasField(name):
            continue
        v = getattr(s, name)
        if not ((low <= v if closed else low < v) and v <= high):
            bracket = "[" if closed else "("
            raise bad(f"sampling.{name}: must be in {bracket}{low:g}, {high:g}], got {v}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise bad(f"sampling.logit_bias: at most {MAX_LOGIT_BIAS} entries, got "
                  f"{len(s.logit_bias)}")
    for i, e in enumerate(s.logit_bias):
        if not -100 <= e.bias <= 100:
            raise bad(f"sampling.logit_bias[{i}].bias: must be in [-100, 100], got {e.bias}")
    words, ids = len(s.bad_words), sum(len(w.ids) for w in s.bad_words)
    if words > MAX_BAD_WORDS or ids > MAX_BAD_WORD_IDS:
        raise bad(f"sampling.bad_words: at most {MAX_BAD_WORDS} entries and {MAX_BAD_WORD_IDS} "
                  f"ids in all, got {words} and {ids}")
    if any(not w.ids for w in s.bad_words):
        i = next(i for i, w in enumerate(s.bad_words) if not w.ids)
        raise bad(f"sampling.bad_words[{i}].ids: must not be empty")
    if s.HasField("logprobs") and s.logprobs > MAX_LOGPROBS:
        raise bad(f"sampling.logprobs: must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
