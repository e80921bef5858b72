"""The gateway's routing core: everything that decides where a request runs and carries it
there, with no front end in it (no grpc.ServicerContext, no HTTP, no ext_proc). The three front
ends (gateway/grpc_api/, gateway/http/, gateway/epp/) are thin layers over it, and
gateway/assembly.py builds the one core they share (design.md §6).

How a request flows through it:
    front end -> tenants (who calls, the cache salt) -> request_checks (refuse what a worker
    would) -> tokenize (the workers' own tokenizer) -> proxy (hash the pages, route, stream,
    retry, resume) -> router (under one lock: index + policy + load) -> the chosen worker.

Modules:
- proxy.py: `GenerateProxy`, the Generate path callable from Python (`open` -> `ProxiedStream`),
  `ProxyError` (a gRPC status each front end translates).
- router.py: `Router`, the routing state behind one lock: the accepted workers, the index, the
  policy and the load; RoutePreview and ListWorkers answers.
- index.py: `KvIndex`, page hash -> which workers hold it on which medium, fed by the workers'
  KV event streams.
- routed_prefixes.py: `RoutedPrefixes`, what the gateway itself routed where (the index of
  engines that publish no events, and the affinity policy's memory of recent prompts); its pages
  in C (routed_native.py, csrc/routed_table.c) where the page table's library loads.
- policies/: the routing policies (affinity, approx, and the baselines) and `LoadTracker`.
- workers.py: worker lifecycle: identify, admit into the fleet (`Fleet`), probe readiness, feed
  the worker's event stream into the router (`WorkerSet`, `WorkerSettings`).
- feeds.py: `FeedLoop`, the one asyncio thread every worker's gRPC streams run on, and
  `BatchApplier`, which applies their events to the router in bulk, in bounded slices.
- feed_streams.py: one worker's event stream followed (subscribe, resume, hand items to a
  sink), without the router: the feed process (feed_process.py) imports it alone.
- discovery.py: where the workers are (a static list, or DNS of a headless Service).
- running_calls.py: the calls in progress (Abort and the drain look them up here).
- tenants.py: bearer tokens -> tenants and their cache salts.
- tokenize.py: the gateway's tokenizer (the workers' own, fetched from them by default).
- request_checks.py: what is refused before tokenizing, hashing or routing.
- metrics.py: the gateway's Prometheus metrics.
"""
