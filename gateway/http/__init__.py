"""The gateway's OpenAI-compatible HTTP front end (`--http-port`): `POST /v1/completions`,
`POST /v1/chat/completions`, `GET /v1/models` and `GET /health` (and vLLM's `/tokenize`,
`/detokenize`, `/version`, `/ping`, `/metrics`), over the same routing core as
the gRPC port (gateway/core/proxy.py), served by uvicorn inside the gateway process. Needs the
`gateway` extra (fastapi, uvicorn, sse-starlette).

- app.py: `create_app`, the FastAPI app (and the API's contract: usage, choices, models);
- routes/: one `APIRouter` per route family; deps.py: what they depend on (`Depends`);
- respond.py: a generation request's worker calls and its JSON or SSE response;
- generation.py: the calls of one request, read concurrently; streaming.py: SSE and stop
  strings; schemas.py: the OpenAI request and response shapes; request_fields.py: the fields
  refused by name (and unknown ones); choices.py and logprobs.py: a choice's shape, whole or
  streamed, with its logprobs; models.py: the model catalog;
- errors.py: OpenAI's error bodies; body_limit.py: the request size limit;
- server.py: uvicorn on its own thread, tied to the gateway's lifecycle; bounds.py: its
  slow-client bounds (no HTTP dependency: `python -m gateway` reads their defaults)."""
