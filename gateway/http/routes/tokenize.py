"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes (vllm/entrypoints/serve/tokenize/
protocol.py, 0.33): a text prompt (`prompt`, `add_special_tokens`) or a chat (`messages`,
`add_generation_prompt`) to the ids the workers would compute, with the workers' tokenizer and
chat template, so a client counts tokens exactly as the gateway routes them; and ids back to
text. A tenant's calls, as GetTokenizer is (with --allow-anonymous, anyone's). Fields vLLM has and
this gateway does not implement are refused by name (request_fields.py)."""
from __future__ import annotations

from typing import Any

import anyio
import grpc
from anyio import to_thread
from fastapi import APIRouter, Depends
from pydantic import ConfigDict, Field, model_validator

from gateway.core.proxy import GenerateProxy, ProxyError
from gateway.core.tenants import Tenant
from gateway.http import deps, respond, schemas, tools
from gateway.http.errors import bad_request, from_proxy
from gateway.http.models import ModelCatalog
from gateway.http.request_fields import refusals
from gateway.http.schemas import ChatMessage, TokenId, _Body
from prefixcache_client.tokenizer import NoChatTemplate

router = APIRouter()


class TokenizeRequest(_Body):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest: exactly one of prompt/messages."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's default per form: text True, chat False
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    # Handed to the chat template as the chat completion's are (gateway/http/tools.py).
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of `prompt` (text) and `messages` (a chat)")
        return self


class DetokenizeRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None
    tokens: list[TokenId]


def _ids(proxy: GenerateProxy, body: TokenizeRequest) -> list[int]:
    tok = proxy.tokenizer
    try:
        if body.messages is not None:
            if body.add_special_tokens:
                raise bad_request("add_special_tokens", "a chat's special tokens are its "
                                  "template's; only false is accepted")
            # The chat as /v1/chat/completions renders it: tool calls, tool results, tools.
            chat = tools.template_messages(schemas.ChatCompletionRequest.chat(body))
            return list(tok.chat_prompt_ids(chat, body.add_generation_prompt, body.tools))
        if body.add_special_tokens is not False or tok.current() is None:
            # The workers' BOS rule; TokenizerUnavailable when the gateway knows no tokenizer.
            return list(tok.text_ids(body.prompt))
        return list(tok.current().encode(body.prompt))
    except NoChatTemplate:
        raise bad_request("messages", "this model has no chat template") from None
    except ValueError as exc:  # TokenizerUnavailable (with its status), ChatTemplateError
        code = getattr(exc, "code", grpc.StatusCode.INVALID_ARGUMENT)
        raise from_proxy(ProxyError(code, str(exc))) from None


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, _: Tenant = Depends(deps.tenant),
                   proxy: GenerateProxy = Depends(deps.proxy),
                   catalog: ModelCatalog = Depends(deps.catalog),
                   limiter: anyio.CapacityLimiter = Depends(deps.limiter)) -> dict[str, Any]:
    kind = "chat" if body.messages is not None else "completion"
    respond.refuse_unsupported(refusals(body.model_extra or {}, kind))
    _, models = await catalog.resolve(body.model)
    ids = await to_thread.run_sync(_ids, proxy, body, limiter=limiter)
    tok = proxy.tokenizer.current()
    strs = ([tok.decode([t], skip_special_tokens=False) for t in ids]
            if body.return_token_strs and tok is not None else None)
    return {"count": len(ids), "max_model_len": models.max_model_len, "tokens": ids,
            "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, _: Tenant = Depends(deps.tenant),
                     proxy: GenerateProxy = Depends(deps.proxy),
                     catalog: ModelCatalog = Depends(deps.catalog)) -> dict[str, Any]:
    respond.refuse_unsupported(refusals(body.model_extra or {}))
    await catalog.resolve(body.model)
    info = proxy.fleet.info
    if info is not None:
        bad = next((t for t in body.tokens if t >= info.vocab_size), None)
        if bad is not None:
            raise bad_request("tokens", f"{bad} is outside the vocabulary [0, "
                                        f"{info.vocab_size})")
    tok = proxy.tokenizer.current()
    if tok is None:
        raise bad_request("tokens", "the gateway knows no tokenizer (no worker has one)")
    return {"prompt": tok.decode(body.tokens)}
