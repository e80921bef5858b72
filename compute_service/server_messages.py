"""Between the ComputeService's gRPC messages and the engine: a Generate request's fields checked
and converted into `Engine.submit` arguments, engine outputs into GenerateResponse messages, and
GetModelInfo. Every check raises with a message that starts with the field it is about: a
ValueError (INVALID_ARGUMENT, as `Engine.submit`'s own) or `Rejected` with its status code (the
codes are listed in compute_service.server's docstring)."""
from __future__ import annotations

import json
import uuid

import grpc

from compute_service.engine import Engine, FinishReason, Output, RequestStats, SamplingParams
from compute_service.engine.sampling import MAX_LOGIT_BIAS, Constraint
from compute_service.model import SamplingDefaults, Tokenizer
from compute_service.sizing import kv_bytes_per_page, mamba_bytes_per_slot
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.limits import (MAX_NAME_BYTES, PROMPT_CACHE_RETENTION_S, name_too_long,
                                      prompt_cache_retention_problem, request_id_too_long,
                                      stop_token_ids_problem, text_too_long)
from service_shell import SALT_METADATA_KEY
from service_shell.metadata import MAX_REQUEST_SCOPE_BYTES, REQUEST_SCOPE_METADATA_KEY

DEFAULT_MAX_TOKENS = 16  # what max_tokens = 0 means (the proto's contract)
_FINISH_REASON = {FinishReason.STOP: pb.FINISH_REASON_STOP,
                  FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                  FinishReason.ABORT: pb.FINISH_REASON_ABORT}


class Rejected(Exception):
    """A call refused with `code`; `message` starts with the field it is about."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(code, message)
        self.code, self.message = code, message


def model_info(engine: Engine, defaults: SamplingDefaults) -> pb.GetModelInfoResponse:
    """What GetModelInfo answers; `adapters` is as of this call (they come and go)."""
    mc, tok = engine.model.config, engine.tokenizer
    info = pb.GetModelInfoResponse(
        model_id=engine.cfg.model_id, architecture=mc.model_type, vocab_size=engine.vocab_size,
        max_context_tokens=engine.context_limit, page_size=engine.cfg.page_size,
        num_attention_layers=len(mc.attention_layer_ids),
        num_mamba_layers=len(mc.mamba_layer_ids), eos_token_ids=engine.eos,
        worker=engine.cfg.pool_id, adapters=engine.adapter_names(),
        tokenizer_fingerprint=tok.fingerprint, has_chat_template=tok.chat_template is not None,
        sampling_defaults=pb.SamplingParams(temperature=defaults.temperature,
                                            top_k=defaults.top_k, top_p=defaults.top_p))
    if tok.adds_bos and tok.bos_token_id is not None:
        info.bos_token_id = tok.bos_token_id
    # The pools as sized (compute_service.sizing), so operators and gateways see the capacity.
    cfg, dtype = engine.cfg, engine.model.dtype
    info.device_pages, info.host_pages = cfg.device_pages, cfg.host_pages
    info.mamba_slots = engine.ckpt_slots
    info.kv_bytes_per_page = kv_bytes_per_page(mc, cfg.page_size, dtype)
    info.mamba_bytes_per_slot = mamba_bytes_per_slot(mc, dtype)
    running_slots = cfg.max_running if engine.mamba else 0
    info.kv_device_bytes = (cfg.device_pages * info.kv_bytes_per_page
                            + (running_slots + engine.ckpt_slots) * info.mamba_bytes_per_slot)
    return info


def tokenizer_response(tok: Tokenizer) -> pb.GetTokenizerResponse:
    """What GetTokenizer answers; FAILED_PRECONDITION for a worker without a tokenizer."""
    if not tok.fingerprint:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                       "this worker has no tokenizer (its checkpoint has no tokenizer.json); it "
                       "serves token-id prompts only")
    return pb.GetTokenizerResponse(
        fingerprint=tok.fingerprint,
        files=[pb.TokenizerFile(name=n, content=tok.files[n]) for n in sorted(tok.files)])


def request_id_of(request: pb.GenerateRequest) -> str:
    """The request's id, or a new one when it sent none."""
    request_id = request.request_id or uuid.uuid4().hex
    problem = request_id_too_long(request_id)
    if problem is not None:
        raise ValueError(problem)
    return request_id


def scope_of(metadata) -> str:
    """The request-id scope of a call's invocation metadata ("" = none): the gateway's, or the
    data plane's as the EPP set it, naming the tenant whose ids these are."""
    values = [v for k, v in metadata or () if k == REQUEST_SCOPE_METADATA_KEY]
    if len(values) > 1:
        raise ValueError(f"{REQUEST_SCOPE_METADATA_KEY}: sent {len(values)} times; a request "
                         "has one tenant")
    scope = values[0] if values else ""
    if len(scope.encode()) > MAX_REQUEST_SCOPE_BYTES or "/" in scope:
        raise ValueError(f"{REQUEST_SCOPE_METADATA_KEY}: must be at most "
                         f"{MAX_REQUEST_SCOPE_BYTES} bytes without '/'")
    return scope


def scoped_request_id(scope: str, request_id: str) -> str:
    """The id a request runs under on this worker: the client's within its tenant's scope, so
    that two tenants' equal ids neither collide nor reach each other's requests."""
    return f"{scope}/{request_id}" if scope else request_id


def check_names(request: pb.GenerateRequest) -> None:
    """The adapter name and the stop token ids against prefixcache_client.limits, the gateway's
    limits too: an unknown adapter's NOT_FOUND quotes the name, and a 10 MB one went into the
    call's trailing metadata (over gRPC's limit) and the worker's log."""
    problem = (name_too_long(request.adapter, "adapter")
               or stop_token_ids_problem(len(request.sampling.stop_token_ids))
               or prompt_cache_retention_problem(request.prompt_cache_retention))
    if problem is not None:
        raise ValueError(problem)


def retain_s_of(request: pb.GenerateRequest) -> float:
    """Seconds the request asks its prefix kept on device (MatchOp.retain_s; check_names
    checked the value): prompt_cache_retention "24h" -> 86400. The worker ignores
    prompt_cache_key (the gateway routes by it)."""
    return PROMPT_CACHE_RETENTION_S[request.prompt_cache_retention]


def salt_of(metadata) -> str:
    """The tenant salt of a call's invocation metadata ("" = none)."""
    values = [v for k, v in metadata or () if k == SALT_METADATA_KEY]
    if len(values) > 1:  # two tenants claimed for one request: never guess which one
        raise ValueError(f"{SALT_METADATA_KEY}: sent {len(values)} times; a request has one tenant")
    salt = values[0] if values else ""
    if len(salt.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"{SALT_METADATA_KEY}: must be at most {MAX_NAME_BYTES} bytes, "
                         f"got {len(salt.encode())}")
    return salt


def prompt_of(request: pb.GenerateRequest, tok: Tokenizer,
              max_context_tokens: int | None = None) -> list[int]:
    """The prompt's ids. A text longer than `max_context_tokens` allows (prefixcache_client.
    limits) is refused before it is tokenized: tokenizing costs memory in proportion to it."""
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        return list(request.token_ids.ids)  # taken exactly as sent
    if which == "text" and request.text:
        if max_context_tokens is not None:
            problem = text_too_long(request.text, max_context_tokens)
            if problem is not None:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if not tok.fingerprint:  # NoTokenizer: a state of this worker, not bad input
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                           "prompt.text: this worker has no tokenizer (its checkpoint has no "
                           "tokenizer.json); send token_ids")
        # The shared BOS rule (prefixcache_client.tokenizer): the gateway applies it too.
        return tok.text_prompt_ids(request.text)
    return []  # unset or empty text: Engine.submit names the field


def sampling_of(s: pb.SamplingParams, vocab_size: int,
                defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """The request's sampling; temperature, top_k and top_p it leaves unset take the
    checkpoint's `defaults`, else greedy / off."""
    def pick(field: str, fallback: float) -> float:
        if s.HasField(field):
            return getattr(s, field)
        default = getattr(defaults, field)
        return fallback if default is None else default

    return SamplingParams(
        temperature=pick("temperature", 0.0), top_k=int(pick("top_k", 0)),
        top_p=pick("top_p", 1.0), seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens or DEFAULT_MAX_TOKENS, min_tokens=s.min_tokens,
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=(s.repetition_penalty if s.HasField("repetition_penalty") else 1.0),
        min_p=s.min_p, logit_bias=logit_bias_of(s, vocab_size),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        bad_words=tuple(tuple(w.ids) for w in s.bad_words),
        constraint=constraint_of(s),
    ).validate(vocab_size)


def logit_bias_of(s: pb.SamplingParams, vocab_size: int) -> dict[int, float]:
    """The request's {token id: bias}; ValueError naming the entry that is out of range or
    repeats a token."""
    out: dict[int, float] = {}
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"sampling.logit_bias: at most {MAX_LOGIT_BIAS} entries, got "
                         f"{len(s.logit_bias)}")
    for i, e in enumerate(s.logit_bias):
        if not -100 <= e.bias <= 100:  # NaN fails too
            raise ValueError(f"sampling.logit_bias[{i}].bias: must be in [-100, 100], got "
                             f"{e.bias}")
        if e.token_id >= vocab_size or e.token_id in out:
            raise ValueError(f"sampling.logit_bias[{i}].token_id: {e.token_id} is "
                             + (f"outside [0, {vocab_size})" if e.token_id >= vocab_size
                                else "repeated"))
        out[e.token_id] = e.bias
    return out


def constraint_of(s: pb.SamplingParams) -> Constraint | None:
    """The structured-output constraint of the request (compiled by Engine.submit); choices as
    a JSON list."""
    if not s.HasField("structured_output"):
        return None
    so = s.structured_output
    kind = so.WhichOneof("kind")
    if kind is None:
        raise ValueError("sampling.structured_output: set, but with no kind (json_schema, "
                         "json_object, regex, choice or grammar)")
    if kind == "json_object":
        if not so.json_object:
            raise ValueError("sampling.structured_output.json_object: must be true when set")
        return Constraint("json_object")
    if kind == "choice":
        if not so.choice.values or any(not v for v in so.choice.values):
            raise ValueError("sampling.structured_output.choice: needs at least one choice, "
                             "none of them empty")
        return Constraint("choice", json.dumps(list(so.choice.values)))
    spec = getattr(so, kind)
    if not spec:
        raise ValueError(f"sampling.structured_output.{kind}: must not be empty")
    return Constraint(kind, spec)


def check_fits(prompt_tokens: int, max_tokens: int, limit: int) -> None:
    """OUT_OF_RANGE when the request does not fit this worker's context of `limit` tokens (it may
    fit another worker's: a gateway can route it there)."""
    if prompt_tokens >= limit:
        raise Rejected(grpc.StatusCode.OUT_OF_RANGE,
                       f"prompt: {prompt_tokens} tokens leave no room for output in this "
                       f"worker's context of {limit} tokens")
    if prompt_tokens + max_tokens > limit:
        raise Rejected(grpc.StatusCode.OUT_OF_RANGE,
                       f"sampling.max_tokens: {max_tokens} exceeds the "
                       f"{limit - prompt_tokens} tokens left in this worker's context of "
                       f"{limit} after the {prompt_tokens}-token prompt")


def response(outs: list[Output], request_id: str | None = None) -> pb.GenerateResponse:
    """One message for the outputs queued since the last one; the last carries the stats,
    naming the request by `request_id` (the client's, without its scope) when given."""
    resp = pb.GenerateResponse(token_ids=[t for o in outs for t in o.token_ids],
                               text="".join(o.text for o in outs))
    for lp in (lp for o in outs for lp in o.logprobs or ()):
        resp.logprobs.add(logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                          top_logprobs=[v for _, v in lp.top])
    if outs[-1].stats is not None:
        resp.stats.CopyFrom(_stats_pb(outs[-1].stats))
        if request_id is not None:
            resp.stats.request_id = request_id
    return resp


def _stats_pb(s: RequestStats) -> pb.GenerateStats:
    return pb.GenerateStats(
        request_id=s.request_id, worker=s.worker, prompt_tokens=s.prompt_tokens,
        cached_tokens_device=s.cached_tokens_device, cached_tokens_host=s.cached_tokens_host,
        cached_tokens_remote=s.cached_tokens_remote,
        shared_tokens_in_flight=s.shared_tokens_in_flight,
        computed_prompt_tokens=s.computed_prompt_tokens, output_tokens=s.output_tokens,
        ttft_s=s.ttft_s, total_s=s.total_s, finish_reason=_FINISH_REASON[s.finish_reason],
        preemptions=s.preemptions)


def is_read_error(exc: Exception) -> bool:
    """An adapter directory whose files cannot be read or parsed (permissions, a truncated
    safetensors file, a config that is not UTF-8): bad input, not a fault of the server."""
    return (isinstance(exc, OSError | UnicodeDecodeError)
            or type(exc).__name__ == "SafetensorError")
