"""The prefixcache gateway: routes each request to the worker that holds its prefix, balanced
against load (design.md §6). `python -m gateway` (__main__.py) runs it.

- core/: the routing core: index, policies, router, proxy, workers and their discovery,
  tenants, tokenizer, request checks, metrics (its docstring is the map).
- assembly.py: builds the one core all front ends share, serves them, readiness and drain.
- Front ends, thin layers over the core:
  - grpc_api/: ComputeService (Generate, routed) and GatewayService (RoutePreview, ListWorkers)
    on the main gRPC port;
  - http/: the OpenAI-compatible HTTP API (--http-port);
  - epp/: the Endpoint Picker of the Gateway API Inference Extension (Envoy ext_proc,
    --epp-port).
"""
