"""Request bodies of the OpenAI-compatible API (pydantic) and the response objects it returns.

Requests follow OpenAI's and vLLM's rules for what is accepted:
- No request field is silently ignored. The fields declared here are implemented and validated
  strictly (`strict=True`: "3" is not an integer, 1 is not a boolean), a failure naming the
  field (errors.py). Every other top-level field lands in `model_extra` (`extra="allow"`) and
  is judged by request_fields.py: vLLM's fields this gateway does not implement are accepted
  only with their neutral value, and unknown fields are refused, each a 400 naming the field
  (`unsupported()`): an answer without the asked-for logprobs or with another sampling than
  asked would look right and be wrong.
- vLLM's extra sampling fields are taken where the workers implement them: `ignore_eos`,
  `top_k`, `min_p`, `repetition_penalty`, `bad_words`, `min_tokens`, `stop_token_ids`,
  `cache_salt`.
- OpenAI's prompt-cache hints `prompt_cache_key` and `prompt_cache_retention` (vLLM takes them
  only in its Responses API), on both endpoints.
- Every string of the body is text: JSON's `"\\ud800"` escape decodes to a lone surrogate,
  which no UTF-8 encoder takes (the prompt's encoding failed with a 500). `_Sampling` refuses
  the body before any field is read, naming the first string that has one, wherever it is
  (prompts, message contents, stop strings, the model, ignored fields alike).
- Stop strings and stop token ids are bounded (prefixcache_client.limits: at most 16 stop
  strings of at most 256 characters, 1024 stop token ids), the same limits as every entry point.

Responses are plain dicts with OpenAI's exact keys (built here, so the shapes live in one
place); `usage` carries the `prefixcache` extension (see `usage()`).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from gateway.http.request_fields import refusals
from prefixcache_client.limits import (MAX_NAME_BYTES, MAX_STOP_TOKEN_IDS, QUOTE_LIMIT,
                                     quote_untrusted, stop_problem)

# Samples of one prompt per request; each is one worker call.
MAX_N = 128
MAX_LOGIT_BIAS = 1024  # the workers' bound (compute_service/engine/sampling.py)
MAX_LOGPROBS = 20  # top logprobs per token, the workers' bound (OpenAI's is 20 too)
# Token ids are u32 on the wire (design.md §3); so are the token counts of SamplingParams.
TokenId = Annotated[int, Field(ge=0, lt=2**32)]
_U32 = 2**32
_SURROGATE = re.compile("[\ud800-\udfff]")
# The error type of a lone surrogate; errors.py names `ctx["path"]` as the field.
SURROGATE_ERROR = "unpaired_surrogate"


def _surrogate_at(value: Any, path: str) -> tuple[str, str] | None:
    """(path, what is wrong) of the first string in the raw JSON `value` that holds a lone
    surrogate, or None. `isascii()` first: most strings cost no regex."""
    if isinstance(value, str):
        if value.isascii():
            return None
        m = _SURROGATE.search(value)
        return None if m is None else (path or "body", f"U+{ord(m.group()):04X} at character "
                                                       f"{m.start()}")
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and not k.isascii() and _SURROGATE.search(k):
                return (path or "body", f"in the key {quote_untrusted(k)}")
            name = k if len(str(k)) <= QUOTE_LIMIT else quote_untrusted(str(k))
            found = _surrogate_at(v, f"{path}.{name}" if path else name)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _surrogate_at(v, f"{path}[{i}]")
            if found:
                return found
    return None


class _Body(BaseModel):
    # allow_inf_nan=False: Python's JSON parser takes NaN and Infinity, which pass every bound.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: usage in every chunk; refused when true (_unsupported_sampling).
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """What /v1/completions and /v1/chat/completions share."""
    KIND: ClassVar[str] = ""
    # Undeclared fields are kept (not dropped) for request_fields.refusals (module docstring).
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    # None: the base model. A loaded LoRA adapter's name selects that adapter.
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=100)  # the workers' bound
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # request_fields.KNOWN_IGNORED
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # Token id (a decimal string, as OpenAI's JSON keys are) -> bias added to its logit.
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM's: isolates the request's cache from other salts (Tenant.with_cache_salt).
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's extra sampling parameters.
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    min_p: float | None = Field(None, ge=0, le=1)
    bad_words: list[str] | None = Field(None, max_length=128)  # gateway/http/bad_words.py
    ignore_eos: bool = False
    top_k: int | None = Field(None, ge=-1, lt=_U32)
    min_tokens: int = Field(0, ge=0, lt=_U32)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    # OpenAI's prompt-cache hints (our extension beyond vLLM's chat and completions fields):
    # requests of the tenant with the same key are routed together (gateway/core/cache_keys.py);
    # a key is at most MAX_NAME_BYTES (256) UTF-8 bytes, as other names (request_checks.py).
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_NAME_BYTES)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        found = _surrogate_at(data, "")
        if found is not None:
            path, where = found
            raise PydanticCustomError(
                SURROGATE_ERROR, "{path}: is not valid Unicode text: a lone surrogate ({where}); "
                "encode the text as UTF-8 (a surrogate pair's two halves together)",
                {"path": path, "where": where})
        return data

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    KIND: ClassVar[str] = "completion"  # request_fields.PER_KIND
    # A string, token ids, or a batch of either.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, lt=_U32)
    # Structured output (gateway/http/structured.py checks them).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    echo: bool = False
    # The top logprobs per token (0: the sampled token's only); None: no logprobs.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per entry (a bare string or id list is a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def unsupported(self) -> list[tuple[str, str]]:
        out = _unsupported_sampling(self)
        if self.echo and self.logprobs is not None:
            out.append(("echo", "echo with logprobs needs the prompt's logprobs, which the "
                                "workers do not compute; send echo or logprobs"))
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", "best_of other than n is not supported"))
        return out


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or text parts (joined); None only for an assistant turn without text.
    content: str | list[TextPart] | None = None
    name: str | None = None
    # A tool's answer names the call it answers; an assistant turn may carry its calls
    # (gateway/http/tools.py hands both to the chat template).
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    KIND: ClassVar[str] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=_U32)
    max_completion_tokens: int | None = Field(None, ge=1, lt=_U32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Tools and structured output: gateway/http/tools.py and structured.py check them.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: render the template with the generation prompt (the assistant turn's header).
    add_generation_prompt: bool = True

    def token_limit(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) over max_tokens (the older one)."""
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        """The messages as the chat template reads them ("developer" is OpenAI's newer name
        for "system", which templates know)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": m.text()}
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            out.append(msg)
        return out

    def unsupported(self) -> list[tuple[str, str]]:
        out = _unsupported_sampling(self)
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule
            out.append(("top_logprobs", "needs logprobs: true"))
        return out

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _unsupported_sampling(r: _Sampling) -> list[tuple[str, str]]:
    out = refusals(r.model_extra or {}, r.KIND)
    for key, bias in (r.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= _U32:
            out.append(("logit_bias", f"keys must be token ids (decimal strings), got "
                                      f"{quote_untrusted(key)}"))
            break
        if not -100 <= bias <= 100:
            out.append(("logit_bias", f"the bias of token {key} must be in [-100, 100], got "
                                      f"{bias}"))
            break
    if r.stream_options is not None and r.stream_options.continuous_usage_stats:
        out.append(("stream_options", "continuous_usage_stats is not implemented: the usage "
                                      "comes in the last chunk (include_usage)"))
    problem = stop_problem(r.stop_strings())
    if problem is not None:
        param, message = problem.split(": ", 1)
        out.append((param, message))
    return out


# ----- responses ------------------------------------------------------------------------------

FINISH_REASONS = {1: "stop", 2: "length", 3: "abort"}  # pb.FinishReason -> OpenAI's word


def completion_choice(index: int, text: str, finish: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_choice(index: int, text: str | None, finish: str | None,
                logprobs: list[dict[str, Any]] | None = None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """With `tool_calls`: OpenAI's assistant message that calls tools (content None unless
    the model wrote text before its calls), finish_reason "tool_calls"."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
        finish = "tool_calls" if finish == "stop" else finish
    return {"index": index, "message": message,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish}


def chat_delta(index: int, delta: dict[str, str], finish: str | None,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish}


def envelope(kind: str, rid: str, created: int, model: str, choices: list[dict[str, Any]],
             **extra: Any) -> dict[str, Any]:
    """`kind`: text_completion, chat.completion or chat.completion.chunk."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
            **extra}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          extension: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage, plus `prefixcache`: where the prompt came from (see gateway/http/app.py's
    docstring for the fields)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "prefixcache": extension}


def model_card(model_id: str, created: int, owner: str, max_model_len: int,
               parent: str | None = None) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owner,
            "root": parent or model_id, "parent": parent, "max_model_len": max_model_len}
