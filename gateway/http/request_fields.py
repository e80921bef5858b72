"""The request fields of vLLM's OpenAI API (0.33) that this gateway does not implement, each
refused by name, and the rule for fields nobody knows.

A field is either a declared field of the request schema (gateway/http/schemas.py: implemented,
validated strictly) or handled here; `tests/gateway/test_http_vllm_fields.py` walks every field
of vLLM's ChatCompletionRequest and CompletionRequest (tests/data/vllm_openai_fields_v0_33_0.json)
and fails on one that is neither.

- A field listed here is accepted only with a neutral value (vLLM's default, or null): it then
  changes nothing in vLLM either. Any other value is a 400 naming the field and saying why.
  Silently ignoring it would answer a different request than the one asked: a `request_id` the
  client then cannot find, `prompt_logprobs` that never come.
- A field nobody knows (neither OpenAI's nor vLLM's) is a 400 naming it: a typo such as
  `max_token` or `temprature` would otherwise be ignored and the request served with defaults.
  vLLM logs and ignores such fields; refusing is the stricter of the two, and the one that
  cannot hide a mistake. `KNOWN_IGNORED` names the few fields accepted without effect on
  purpose.

Structured output and tools (response_format, structured_outputs, tools, tool_choice,
parallel_tool_calls) are declared fields of the schema (gateway/http/structured.py, tools.py).
STRUCTURED_OUTPUT keeps only vLLM's old guided_* spelling of them, refused by name.
"""
from __future__ import annotations

from typing import Any

from prefixcache_client.limits import QUOTE_LIMIT, quote_untrusted

# Neutral values: a field set to one of these is accepted (it asks for vLLM's default).
_OFF: tuple[Any, ...] = (None,)

# Structured output's old spellings, refused by name (see the docstring).
STRUCTURED_OUTPUT: dict[str, tuple[tuple[Any, ...], str]] = {
    # vLLM < 0.12 spelled structured output as guided_*: named, so the old spelling is not
    # mistaken for a typo.
    **{f"guided_{k}": (_OFF, "vLLM's old spelling of structured output: use "
                              "structured_outputs or response_format")
       for k in ("json", "regex", "choice", "grammar", "decoding_backend", "whitespace_pattern")},
}

# vLLM's other fields this gateway does not implement: name -> (neutral values, why).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "reasoning_effort": (_OFF, "reasoning models are not served"),
    "thinking_token_budget": (_OFF, "reasoning models are not served"),
    "include_reasoning": ((None, True), "reasoning models are not served"),
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1.0, 1), "a length penalty applies to beam search, which is not "
                       "implemented"),
    "watermarking": (_OFF, "watermarking is not implemented"),
    "include_stop_str_in_output": ((None, False), "stop strings are never included in the "
                                   "output"),
    "skip_special_tokens": ((None, True), "special tokens are always skipped in the text"),
    "spaces_between_special_tokens": ((None, True), "special tokens are skipped, so there is "
                                      "nothing to space"),
    "truncate_prompt_tokens": (_OFF, "prompts are never truncated: one that does not fit is "
                               "refused"),
    "truncation_side": (_OFF, "prompts are never truncated"),
    "prompt_logprobs": (_OFF, "the workers do not compute prompt logprobs"),
    "logprob_token_ids": (_OFF, "logprobs of chosen token ids are not implemented; use "
                          "logprobs / top_logprobs"),
    "allowed_token_ids": (_OFF, "allowed_token_ids is not implemented; use logit_bias"),
    "continue_final_message": ((None, False), "continuing the final message is not "
                               "implemented"),
    "documents": (_OFF, "documents for the chat template are not implemented"),
    "chat_template": (_OFF, "the model's own chat template is always used (the gateway routes "
                      "on the ids it renders)"),
    "chat_template_kwargs": ((None, {}), "chat template arguments are not implemented"),
    "media_io_kwargs": (_OFF, "multimodal input is not served"),
    "mm_processor_kwargs": (_OFF, "multimodal input is not served"),
    "mm_payload": ((None, "tensors"), "multimodal input is not served"),
    "return_mm_kwargs": ((None, False), "multimodal input is not served"),
    "prompt_embeds": (_OFF, "prompt embeddings are not served"),
    "priority": ((None, 0), "priority scheduling is not implemented"),
    "request_id": (_OFF, "the gateway names requests itself (the response's id)"),
    "session_id": (_OFF, "sessions are not implemented; prefix reuse needs none"),
    "return_tokens_as_token_ids": ((None, False), "not implemented"),
    "return_token_ids": ((None, False), "not implemented"),
    "return_weight_versions": ((None, False), "not implemented"),
    "routed_experts_prompt_start": ((None, 0), "not implemented"),
    "return_token_offsets": ((None, False), "not implemented"),
    "return_prompt_text": ((None, False), "not implemented"),
    "kv_transfer_params": (_OFF, "disaggregated prefill (KV transfer) is not implemented; the "
                           "cache service shares KV across workers"),
    "ec_transfer_params": (_OFF, "encoder cache transfer is not implemented"),
    "vllm_xargs": ((None, {}), "vLLM's extra arguments for custom logits processors are not "
                   "implemented"),
    "repetition_detection": (_OFF, "repetition detection is not implemented"),
    "stream_interval": ((None, 1), "every token is streamed as it comes"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "echo": ((None, False), "echo is implemented for /v1/completions only"),
}

# Fields whose neutral value differs by endpoint (vLLM's defaults differ): kind -> neutral.
# add_special_tokens: a text prompt gets the workers' BOS rule (True), a chat its template's
# tokens only (False).
PER_KIND: dict[str, dict[str, tuple[Any, ...]]] = {
    "add_special_tokens": {"completion": (None, True), "chat": (None, False)},
}
REFUSED["add_special_tokens"] = ((None,), "the special tokens are always vLLM's default for "
                                 "the endpoint: a text prompt's BOS rule, a chat's template")

# Accepted without effect on purpose (the answer does not depend on them, in OpenAI or vLLM).
KNOWN_IGNORED: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring; it changes no answer",
}


def refusals(extra: dict[str, Any], kind: str = "") -> list[tuple[str, str]]:
    """(field, why) for each field of `extra` (the body's fields the schema does not declare)
    that is unknown, or a refused field set to a value other than a neutral one; `kind`
    ("completion" or "chat") picks PER_KIND's neutral values."""
    out = []
    for name, value in extra.items():
        known = STRUCTURED_OUTPUT.get(name) or REFUSED.get(name)
        if known is None:
            # A field name is the client's text: quoted and cut when long (never echoed whole).
            name = name if len(name) <= QUOTE_LIMIT else quote_untrusted(name)
            out.append((name, "unknown field: not a parameter of OpenAI's or vLLM's API "
                              "(check its spelling)"))
        elif not _neutral(value, PER_KIND.get(name, {}).get(kind, known[0])):
            out.append((name, f"{known[1]} (only its default is accepted)"))
    return out


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # `True == 1` in Python: compare types too, so `priority: false` is not taken for 0.
    return any(value == n and type(value) is type(n) for n in neutral if n is not None) \
        or value is None


def status(name: str) -> str:
    """"refused" or "ignored" for a field handled here, "unknown" otherwise (the schema's own
    fields are the implemented ones)."""
    if name in STRUCTURED_OUTPUT or name in REFUSED:
        return "refused"
    return "ignored" if name in KNOWN_IGNORED else "unknown"
