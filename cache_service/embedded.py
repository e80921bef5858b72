"""The cache service in-process: the one module of `cache_service` that the compute service
imports (tests/test_import_rules.py holds it to that).

A compute worker started with `--cache-service embedded` runs without a cache service process
(a single worker, tests, benchmarks): it calls the cache core directly instead of through
`prefixcache_client.CacheClient`. Both answer the same Step/Match/... calls with the same
messages and raise the same `prefixcache_client.CacheError`, so the engine cannot tell them
apart. Everything else the services share lives outside both of them: the L3 page store in
`pagestore`, the page hash and token pages in `prefixcache_client`. Anything more the compute
service wants from here is a new name added below, on purpose, not an import of an internal.

    CacheCore          the cache service's core (radix trees, leases, tiers, events) without
                       gRPC; `CacheCore(remote=L3Client)` probes L3 for remote lookups as the
                       service does
    configure_hashing  how the core hashes pages (native kernel or Python, and where built
                       kernels are kept): the worker sets it from its --cache-native and
                       --kernel-cache flags, as the cache service does from its own
"""
from cache_service.chain_hash import configure as configure_hashing
from cache_service.core import CacheCore

__all__ = ["CacheCore", "configure_hashing"]
