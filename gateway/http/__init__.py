"""The gateway's OpenAI-compatible HTTP API (`--http-port`): FastAPI routes (app.py) over the
same routing core as the gRPC port (gateway/core/proxy.py), served by uvicorn inside the gateway
process (server.py). Needs the `gateway` extra (fastapi, uvicorn, sse-starlette)."""
