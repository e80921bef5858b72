"""Every request field of vLLM 0.33's completions, chat and tokenize protocols (vendored names:
tests/data/vllm_openai_fields_v0_33_0.json, extracted by tests/data/extract_vllm_fields.py) is
implemented (a declared field of our schema) or refused by name (gateway/http/request_fields.py)
when set to anything but its neutral value; none is silently ignored. And every endpoint of
vLLM's routers is served or named, with its reason, as not served."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.http import request_fields
from gateway.http.routes.tokenize import DetokenizeRequest, TokenizeRequest
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest

FIELDS = json.loads((Path(__file__).parents[1] / "data" / "vllm_openai_fields_v0_33_0.json")
                    .read_text())
BASE = {"completion": {"prompt": "x"}, "chat": {"messages": [{"role": "user", "content": "x"}]},
        "tokenize_completion": {"prompt": "x"}, "tokenize_chat": {"messages": [
            {"role": "user", "content": "x"}]}, "detokenize": {"tokens": [1]}}
SCHEMA = {"completion": CompletionRequest, "chat": ChatCompletionRequest,
          "tokenize_completion": TokenizeRequest, "tokenize_chat": TokenizeRequest,
          "detokenize": DetokenizeRequest}
NOT_NEUTRAL = "a value no field takes as its default"


def _refusals(kind: str, body: dict) -> list[tuple[str, str]]:
    r = SCHEMA[kind].model_validate(body)
    if hasattr(r, "unsupported"):
        return r.unsupported()
    kind = "chat" if "messages" in body else "completion"
    return request_fields.refusals(r.model_extra or {}, kind)


CASES = [(kind, name) for kind in SCHEMA for name in FIELDS[kind]]


def test_the_vendored_lists_are_vllms():
    assert FIELDS["source"].startswith("vllm 0.33.0")
    assert len(FIELDS["chat"]) > 60 and len(FIELDS["completion"]) > 50
    assert {"cache_salt", "logprobs", "repetition_penalty", "structured_outputs"} <= set(
        FIELDS["chat"])


@pytest.mark.parametrize("kind,name", CASES)
def test_every_vllm_field_is_implemented_or_refused_by_name(kind, name):
    implemented = name in SCHEMA[kind].model_fields
    if implemented:
        return
    assert request_fields.status(name) == "refused", (
        f"{kind}.{name}: neither implemented nor refused by name: declare it in the schema or "
        "list it in gateway/http/request_fields.py")
    # Its neutral value (vLLM's default) is accepted; anything else is a 400 naming it.
    assert _refusals(kind, {**BASE[kind], name: None}) == []
    problems = _refusals(kind, {**BASE[kind], name: NOT_NEUTRAL})
    assert [p for p, _ in problems] == [name]
    assert "only its default is accepted" in problems[0][1]


def test_unknown_fields_are_refused_by_name_and_structured_output_is_implemented():
    problems = _refusals("chat", {**BASE["chat"], "temprature": 0.5})
    assert problems[0][0] == "temprature" and "unknown field" in problems[0][1]
    # Structured output and tools are implemented (gateway/http/structured.py, tools.py):
    # declared fields of the schema, none of them refused; only guided_* stays refused by name.
    implemented = {"response_format", "structured_outputs", "tools", "tool_choice",
                   "parallel_tool_calls"}
    assert implemented <= set(ChatCompletionRequest.model_fields)
    assert {"response_format", "structured_outputs"} <= set(CompletionRequest.model_fields)
    assert not implemented & (set(request_fields.STRUCTURED_OUTPUT) | set(request_fields.REFUSED))
    assert all(n.startswith("guided_") for n in request_fields.STRUCTURED_OUTPUT)
    assert request_fields.status("guided_json") == "refused"
    assert not set(request_fields.STRUCTURED_OUTPUT) & set(request_fields.REFUSED)
    assert _refusals("chat", {**BASE["chat"], "response_format": {"type": "text"},
                              "tool_choice": "none", "tools": []}) == []
    # `True == 1` in Python, not in a request: priority false is not priority 0.
    assert [p for p, _ in _refusals("completion", {**BASE["completion"], "priority": False})] \
        == ["priority"]
    for name in request_fields.KNOWN_IGNORED:  # accepted on purpose: declared and documented
        assert name in CompletionRequest.model_fields and name in ChatCompletionRequest.model_fields


def test_every_vllm_endpoint_is_served_or_named_as_not_served():
    """vLLM's routers (vendored (method, path) list) against this gateway's: each is served with
    that method, or listed in NOT_SERVED with its reason (and then not served)."""
    from gateway.http.routes import NOT_SERVED, ROUTERS

    ours = {(m, r.path) for router in ROUTERS for r in router.routes for m in r.methods}
    missing = [(m, p) for m, p in FIELDS["endpoints"]
               if (m, p) not in ours and p not in NOT_SERVED
               and not p.startswith("/v1/responses/")]
    assert missing == []
    assert not {p for _, p in ours} & set(NOT_SERVED)
    # /v1/responses/{id}... are answered by the responses router's catch-all (a 404 with why).
    assert ("GET", "/v1/responses/{rest:path}") in ours and ("POST", "/v1/responses") in ours
    assert ("GET", "/metrics") in ours  # vLLM's comes from its Prometheus instrumentator
