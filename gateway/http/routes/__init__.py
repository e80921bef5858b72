"""The HTTP API's routes, one `APIRouter` per family, each importable and servable alone
(its dependencies in gateway/http/deps.py): health.py (`GET /health`), models.py
(`GET /v1/models`), completions.py (`POST /v1/completions`), chat.py
(`POST /v1/chat/completions`), tokenize.py (`POST /tokenize`, `POST /detokenize`), service.py
(`GET /version`, `/ping`, `GET /metrics`), responses.py (`/v1/responses`: a 404 saying why).
`ROUTERS` is what app.py includes, in this order."""
from __future__ import annotations

from gateway.http.routes import (chat, completions, health, models, responses, service,
                                 tokenize)

ROUTERS = (health.router, models.router, completions.router, chat.router, tokenize.router,
           service.router, responses.router)

# vLLM 0.33's endpoints this gateway does not serve (404), and why; the others it serves
# (tests/gateway/test_http_vllm_fields.py checks both against vLLM's routers).
NOT_SERVED = {
    "/v1/chat/completions/batch": "send the chats as separate requests: they run concurrently "
                                  "and share their common prefix from cache",
    "/v1/decisions": "vLLM-specific, outside the OpenAI API",
    "/kv_event_sources": "KV events come from the cache service (docs/kv-events.md), not "
                         "from the API port",
    "/load": "load is in GET /metrics and drives the gateway's routing",
    "/invocations": "SageMaker's endpoint: call /v1/chat/completions or /v1/completions",
    "/tokenizer_info": "the tokenizer's files are served by GetTokenizer on the gRPC port",
}
