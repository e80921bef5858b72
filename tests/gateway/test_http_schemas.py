"""The HTTP API's request schemas (strict types, unknown and unsupported fields refused by
name) and its errors: OpenAI's JSON with the right status, naming the field, never a
traceback."""
from __future__ import annotations

import grpc
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from gateway.core.proxy import ProxyError
from gateway.http import errors
from gateway.http.errors import from_proxy
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("prompt,prompts", [
    ("hi", ["hi"]), ([1, 2, 3], [[1, 2, 3]]), (["a", "b"], ["a", "b"]),
    ([[1], [2, 3]], [[1], [2, 3]])])
def test_prompt_forms(prompt, prompts):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == prompts


def test_defaults_and_unknown_fields():
    r = CompletionRequest.model_validate({"prompt": "x", "user": "u", "best_of": 1,
                                          "skip_special_tokens": True, "priority": 0})
    assert r.max_tokens == 16 and r.n == 1 and not r.stream and r.model is None
    assert r.unsupported() == [] and r.stop_strings() == []
    # A typo is not served with defaults: it is a 400 naming it.
    r = CompletionRequest.model_validate({"prompt": "x", "max_token": 5, "priority": False})
    assert [f for f, _ in r.unsupported()] == ["max_token", "priority"]
    assert "unknown field" in r.unsupported()[0][1]
    assert CompletionRequest.model_validate({"prompt": "x", "stop": "##"}).stop_strings() == ["##"]


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "16"), ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", "0.5"),
    ("temperature", -1), ("top_p", 1.5), ("n", 0), ("n", True), ("seed", -1), ("stream", 1),
    ("stream", "true"), ("stop", 3), ("stop", [1]), ("ignore_eos", "yes"), ("prompt", 3),
    ("prompt", [1, -2]), ("prompt", [1, "a"]), ("model", 7), ("stream_options", True),
    ("stop_token_ids", ["1"]), ("max_tokens", 2**32), ("top_k", 2**32)])
def test_types_are_validated_strictly(field, value):
    body = {"prompt": "x", field: value}
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate(body)
    assert err.value.errors()[0]["loc"][0] == field


def test_unsupported_fields_are_refused_by_name():
    r = CompletionRequest.model_validate({"prompt": "x", "logprobs": 2, "echo": True,
                                          "presence_penalty": 0.5, "stop": ["", "a"],
                                          "suffix": "s", "logit_bias": {"x1": 1.0}})
    assert [f for f, _ in r.unsupported()] == ["suffix", "logit_bias", "stop", "echo"]
    c = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "top_logprobs": 2, "tools": [{"type": "f"}],
                                              "response_format": {"type": "text"}})
    # tools and response_format: gateway/http/tools.py and structured.py check them.
    assert [f for f, _ in c.unsupported()] == ["top_logprobs"]


def test_chat_messages():
    c = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text",
                                                                     "text": "lo"}]},
        {"role": "assistant", "content": None}], "max_tokens": 5, "max_completion_tokens": 7})
    assert c.chat() == [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hello"},
                        {"role": "assistant", "content": ""}]
    assert c.token_limit() == 7 and c.add_generation_prompt
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user", "content": 5}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(bad)


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    errors.install(app)

    @app.post("/c")
    async def complete(body: CompletionRequest) -> dict:
        return {"ok": True}

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict:
        return {"ok": True}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("secret internals")

    @app.get("/proxy")
    async def proxy_error() -> dict:
        raise ProxyError(grpc.StatusCode.RESOURCE_EXHAUSTED, "every worker is full")

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("path,body,param,says", [
    ("/c", {"prompt": "x", "max_tokens": "3"}, "max_tokens", "valid integer"),
    ("/c", {"prompt": 3}, "prompt", "a string, a list of token ids"),
    ("/c", {}, "prompt", "is required"),
    ("/c", {"prompt": "x", "stop": 3}, "stop", "a string or a list of strings"),
    ("/c", {"prompt": "x", "stream_options": {"include_usage": "y"}},
     "stream_options.include_usage", "valid boolean"),
    ("/chat", {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
     "messages[1].role", "'system'"),
    ("/chat", {"messages": [{"role": "user", "content": 1}]}, "messages[0].content",
     "a string or a list"),
])
def test_validation_errors_name_the_field(client, path, body, param, says):
    r = client.post(path, json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and says in error["message"]


def test_bodies_that_are_not_json_objects(client):
    for raw in (b"not json", b"[1, 2]"):
        r = client.post("/c", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_unexpected_errors_are_a_generic_500_and_unknown_routes_404(client, caplog):
    r = client.get("/boom")
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text
    assert "http_unhandled" in caplog.text
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert client.get("/proxy").status_code == 429


@pytest.mark.parametrize("code,status,param", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "top_p"),
    (grpc.StatusCode.OUT_OF_RANGE, 400, "max_tokens"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, None),
    (grpc.StatusCode.NOT_FOUND, 404, "model"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, None),
    (grpc.StatusCode.UNAVAILABLE, 503, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, None),
    (grpc.StatusCode.INTERNAL, 500, None),
])
def test_grpc_codes_map_to_http_statuses(code, status, param):
    field = {"top_p": "sampling.top_p", "max_tokens": "sampling.max_tokens",
             "model": "adapter"}.get(param, "x")
    error = from_proxy(ProxyError(code, f"{field}: something is wrong"))
    assert error.status == status and error.param == param
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if status == 500:  # never the worker's own words: they may hold internals
        assert "something" not in body["message"]


def test_stream_options_fields_are_honoured_or_refused():
    r = CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert [f for f, _ in r.unsupported()] == ["stream_options"]
    ok = CompletionRequest.model_validate({"prompt": "x", "stream_options": {
        "continuous_usage_stats": False}})
    assert ok.unsupported() == []
