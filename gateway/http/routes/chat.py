"""`POST /v1/chat/completions`: the messages rendered with the model's chat template by the
gateway's tokenizer (the one the workers use), so the gateway routes on exactly the ids the
worker computes; `n` choices (gateway/http/respond.py)."""
from __future__ import annotations

import json

import anyio
import grpc
from anyio import to_thread
from fastapi import APIRouter, Depends, Request, Response

from gateway.core.proxy import GenerateProxy, ProxyError
from gateway.core.request_checks import check_text_size
from gateway.core.tenants import Tenant
from gateway.core.tokenize import GatewayTokenizer
from gateway.http import deps, respond, schemas, structured, tools, turns
from gateway.http.generation import Generation
from gateway.http.errors import bad_request, from_proxy
from gateway.http.models import ModelCatalog
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.tokenizer import NoChatTemplate

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: schemas.ChatCompletionRequest, request: Request,
                           who: Tenant = Depends(deps.tenant),
                           proxy: GenerateProxy = Depends(deps.proxy),
                           catalog: ModelCatalog = Depends(deps.catalog),
                           limiter: anyio.CapacityLimiter = Depends(deps.limiter),
                           memory: turns.TurnMemory = Depends(deps.turns)) -> Response:
    respond.refuse_unsupported(body.unsupported())
    tool_plan, constraint = tool_constraint(body, proxy)
    adapter, models = await catalog.resolve(body.model)
    # The messages' text bounded by the context before the template renders it.
    check_text_size("".join(m.text() for m in body.messages), proxy.fleet, "messages")
    salted = who.with_cache_salt(body.cache_salt)
    space = turns.namespace(salted.name, salted.salt, proxy.tokenizer.fingerprint)
    ids, fingerprint = await to_thread.run_sync(chat_ids, proxy, body, memory, space,
                                                limiter=limiter)
    max_tokens = body.token_limit()
    if max_tokens is None:  # OpenAI's default: whatever the context leaves
        max_tokens = models.max_model_len - len(ids)
        if max_tokens < 1:
            raise bad_request("messages", f"the prompt has {len(ids)} tokens and the "
                              f"model's context is {models.max_model_len}")
    req = pb.GenerateRequest(adapter=adapter)
    req.token_ids.ids.extend(ids)
    rid = f"chatcmpl-{request.state.request_id}"  # X-Request-Id (request_log.py)
    return await respond.generate(body, [req], max_tokens, request, who, rid, chat=True,
                                  proxy=proxy, limiter=limiter, fingerprint=fingerprint,
                                  constraint=constraint, tool_plan=tool_plan,
                                  answered=_remembering(memory, space, proxy, tool_plan))


def _remembering(memory: turns.TurnMemory, space: str, proxy: GenerateProxy,
                 tool_plan: tools.ToolPlan | None):
    """What respond.generate calls with the ended generation: its answers remembered for
    token-exact turns; None when the memory is off or the choices' text may be tool calls
    (the client sends those back as `tool_calls`, not as the text)."""
    if not memory.enabled or (tool_plan is not None and tool_plan.calls_tools):
        return None

    def answered(generation: Generation) -> None:
        turns.remember_answers(memory, space, proxy.tokenizer.current(), generation.samples)
    return answered


def tool_constraint(body: schemas.ChatCompletionRequest, proxy: GenerateProxy
                    ) -> tuple[tools.ToolPlan | None, structured.Structured | None]:
    """The request's tool handling and its output constraint: `required` or a named tool
    choice is one (a JSON schema, gateway/http/tools.py), and then no other may be asked."""
    current = proxy.tokenizer.current()
    template = current.chat_template if current is not None else None
    plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, template)
    constraint = structured.from_request(body.response_format, body.structured_outputs)
    schema = tools.constraint_schema(plan, body.parallel_tool_calls) if plan else None
    if schema is None:
        return plan, constraint
    if constraint is not None:
        raise bad_request("tool_choice", f"{plan.mode} tool choice constrains the output "
                          f"itself; it cannot be combined with {constraint.field.split('.')[0]}")
    # A schema the compiler refuses comes from the tools' parameters: the 400 names `tools`.
    return plan, structured.Structured(pb.StructuredOutput(json_schema=json.dumps(schema)),
                                       "tools")


def chat_ids(proxy: GenerateProxy, body: schemas.ChatCompletionRequest,
             memory: turns.TurnMemory | None = None, space: str = "") -> tuple[list[int], str]:
    """The prompt ids of a chat, rendered with the chat template of the tokenizer the workers
    use (gateway/core/tokenize.py's `chat_prompt_ids`), and that tokenizer's fingerprint (only
    workers with it may run these ids). With `memory` on, assistant messages it remembers for
    namespace `space` are their generated ids (turns.py). 400 naming `messages` when the model
    has no template or the template fails on these messages; 503 while the gateway knows no
    tokenizer yet."""
    tokenizer = proxy.tokenizer
    messages = tools.template_messages(body.chat())
    try:
        ids = None
        if memory is not None and memory.enabled:
            ids = _spliced(tokenizer, messages, body, memory, space)
        if ids is None:
            ids = tokenizer.chat_prompt_ids(messages, body.add_generation_prompt, body.tools)
    except NoChatTemplate:
        raise bad_request("messages", "this model has no chat template; send the prompt as "
                                      "text or token ids to /v1/completions") from None
    except ValueError as exc:  # TokenizerUnavailable (with its status), ChatTemplateError
        code = getattr(exc, "code", grpc.StatusCode.INVALID_ARGUMENT)
        message = str(exc).removeprefix("messages: ")
        raise from_proxy(ProxyError(code, f"messages: {message}")) from None
    if not ids:
        raise bad_request("messages", "the chat template rendered an empty prompt")
    return list(ids), tokenizer.fingerprint


def _spliced(tokenizer: GatewayTokenizer, messages: list[dict], body: schemas.ChatCompletionRequest,
             memory: turns.TurnMemory, space: str) -> list[int] | None:
    """The chat's ids with its remembered answers spliced in, or None (none remembered, or the
    template does not write them verbatim)."""
    answers = turns.remembered_answers(memory, space, messages)
    if not answers:
        return None
    # Answers are remembered only from chats the current tokenizer rendered (it never changes
    # once known, gateway/core/tokenize.py), so it is known here.
    current = tokenizer.current()
    if current is None:
        return None
    return turns.spliced_chat_ids(current, messages, answers, body.add_generation_prompt,
                                  body.tools)
