"""The gateway's gRPC front end, on the gateway's main port: prefixcache.v1.ComputeService (the
workers' own API: Generate, Abort, GetModelInfo, GetTokenizer, routed to the workers) and
prefixcache.v1.GatewayService (RoutePreview, ListWorkers), thin adapters over the routing core
(gateway/core/). servicer.py: the servicers and `register`, which adds them to a gRPC server."""
