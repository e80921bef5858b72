"""The gateway's routing index at fleet scale: a load generator replays recorded event streams of
many simulated pools over gRPC into the gateway's real subscription code path, while routing
decisions are timed. `python -m prefixcache_bench.gateway_fleet --help`."""
