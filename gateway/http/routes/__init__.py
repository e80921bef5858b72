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
