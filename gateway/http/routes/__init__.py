"""The HTTP API's routes, one `APIRouter` per family, each importable and servable alone
(its dependencies in gateway/http/deps.py): health.py (`GET /health`), models.py
(`GET /v1/models`), completions.py (`POST /v1/completions`), chat.py
(`POST /v1/chat/completions`). `ROUTERS` is what app.py includes, in this order."""
from __future__ import annotations

from gateway.http.routes import chat, completions, health, models

ROUTERS = (health.router, models.router, completions.router, chat.router)
