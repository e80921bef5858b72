"""`/v1/responses` (OpenAI's Responses API, which vLLM also serves): a 404 that says why, rather
than the bare "not found" of an unknown path. Out of scope on purpose: the Responses API is
stateful (stored responses, `previous_response_id`, background runs, built-in tools), a store
and a lifecycle this stateless gateway does not have, and what it adds for a prefix cache is
already there: a client resends the conversation through /v1/chat/completions and its prefix
is served from cache, never computed twice."""
from __future__ import annotations

from fastapi import APIRouter

from gateway.http.errors import ApiError

router = APIRouter()

WHY = ("/v1/responses is not served: the Responses API is stateful (stored responses, "
       "previous_response_id), which this gateway is not; use /v1/chat/completions and resend "
       "the conversation: its prefix is served from cache")


@router.api_route("/v1/responses", methods=["GET", "POST"])
@router.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"])
async def responses() -> None:
    raise ApiError(404, WHY, "not_found_error", None, "not_implemented")
