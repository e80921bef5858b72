"""OpenAI HTTP requests through the Endpoint Picker: the prompt a `/v1/completions` or
`/v1/chat/completions` body asks for, as the Generate the gateway's own HTTP API would send
(gateway/http/routes/: the same request schemas, the same chat template rendered by the same
tokenizer, so the picker routes on exactly the ids the model server will compute), for the
router to score; and the picker's refusals as OpenAI error bodies.

The picker only routes: it validates what it must read to pick (JSON, `model`, the prompt) and
leaves every other field to the model server, which answers it as the gateway's HTTP API does.
"""
from __future__ import annotations

import json

from pydantic import ValidationError

from gateway.core.proxy import GenerateProxy
from gateway.core.router import Router
from gateway.epp.protocol import Refusal
from gateway.http import schemas
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.limits import quote_untrusted
from prefixcache_client.tokenizer import NoChatTemplate

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
PROMPT_PATHS = (COMPLETIONS_PATH, CHAT_PATH)
# Routed to any worker's model server (no prompt): the least loaded.
PROMPTLESS_PATHS = ("/v1/models", "/health")
PATHS = PROMPT_PATHS + PROMPTLESS_PATHS
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str) -> bytes:
    """An OpenAI error object, as the gateway's HTTP API answers (gateway/http/errors.py)."""
    return json.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"),
                                 "param": None, "code": None}}).encode()


def prompt_request(path: str, body: bytes, proxy: GenerateProxy,
                   router: Router) -> tuple[pb.GenerateRequest, str | None]:
    """(the Generate of the body's first prompt, the tokenizer fingerprint its ids need: the
    gateway's for a chat, None for a completion, as GenerateProxy.prepare takes it). Refusal
    400 for a body the model server would refuse too, 404 for an unknown model."""
    try:
        if path == CHAT_PATH:
            chat = schemas.ChatCompletionRequest.model_validate_json(body)
            request = pb.GenerateRequest(adapter=_adapter(chat.model, proxy, router),
                                         prompt_cache_key=chat.prompt_cache_key or "")
            request.token_ids.ids.extend(_chat_ids(chat, proxy))
            return request, proxy.tokenizer.fingerprint
        completion = schemas.CompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise Refusal(400, f"{where}: {first.get('msg', 'invalid')}") from None
    # The key routes as on the gateway's own API; the retention is the model server's to honour.
    request = pb.GenerateRequest(adapter=_adapter(completion.model, proxy, router),
                                 prompt_cache_key=completion.prompt_cache_key or "")
    prompts = completion.prompts()
    if not prompts or not prompts[0]:
        raise Refusal(400, "prompt: must not be empty")
    if isinstance(prompts[0], str):
        request.text = prompts[0]  # tokenized by prepare(), as the gateway's route does
    else:
        request.token_ids.ids.extend(prompts[0])
    return request, None


def _chat_ids(chat: schemas.ChatCompletionRequest, proxy: GenerateProxy) -> list[int]:
    try:
        ids = proxy.tokenizer.chat_prompt_ids(chat.chat(), chat.add_generation_prompt)
    except NoChatTemplate:
        raise Refusal(400, "messages: this model has no chat template; send the prompt to "
                           "/v1/completions") from None
    except ValueError as exc:  # TokenizerUnavailable, ChatTemplateError
        status = 503 if "unavailable" in type(exc).__name__.lower() else 400
        raise Refusal(status, str(exc)) from None
    if not ids:
        raise Refusal(400, "messages: the chat template rendered an empty prompt")
    return list(ids)


def _adapter(model: str | None, proxy: GenerateProxy, router: Router) -> str:
    """"" for the base model (or none named), the adapter a routable worker has loaded; 404."""
    base = proxy.fleet.model_id
    if model is None or model == base:
        return ""
    for name in router.names():
        worker = router.get(name)
        if worker is not None and model in worker.info.adapters:
            return model
    raise Refusal(404, f"model: {quote_untrusted(model)} does not exist; this pool serves "
                       f"{base} and the adapters its workers have loaded")
