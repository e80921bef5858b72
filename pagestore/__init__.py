"""pagestore: the L3 page store, Redis shared by every worker (design.md §4, "L3 (Redis)").

Used by both services: the compute service writes and loads pages (compute_service.tiers
moves the bytes between device, host and here), the cache service probes which pages are here
for its lookups. A library: it takes its settings as parameters and reads no flag and no
environment variable (service_shell.redis_flags builds the settings from the flags). It imports
neither service and no torch: a payload is bytes here.

    settings.py     RedisSettings: URL, Redis Cluster, ACL password file, TLS files; the
                    redis-py client made from them, the start-up check, redact() for logs
    keys.py         page_key: the Redis key of a page, `<prefix>:<model id>:<page hash hex>`
    client.py       L3Client / L3Config: bounded, breaker-guarded probe / get / set / delete of
                    pages, one pipeline per master on a Redis Cluster; reachability (`up`,
                    check, watch); UNAVAILABLE (a page on a master that could not be asked)
    breaker.py      CircuitBreaker: one per Redis node (closed / open / half-open)
    page_format.py  the payload of a page: byte layout, format version, the digest (a MAC
                    keyed with the L3 MAC key over the Redis key, header and body); seal() and
                    open_payload() on bytes; PayloadRejected with one of REASONS
"""
from pagestore.breaker import CircuitBreaker
from pagestore.client import UNAVAILABLE, L3Client, L3Config, L3Counters
from pagestore.keys import page_key
from pagestore.page_format import FORMAT_VERSION, REASONS, PageFormat, PayloadRejected
from pagestore.settings import RedisSettings, redact

__all__ = ["FORMAT_VERSION", "REASONS", "UNAVAILABLE", "CircuitBreaker", "L3Client", "L3Config",
           "L3Counters", "PageFormat", "PayloadRejected", "RedisSettings", "page_key", "redact"]
