"""The gateway's flags for its routing index and the event ingest that feeds it (gateway/__main__.py
declares the rest)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.core.thread_priority import PRIORITIES, SWITCH_INTERVAL_S
from service_shell import finite_float
from service_shell.config import NATIVE_MODES

if TYPE_CHECKING:
    from gateway.assembly import GatewayConfig
    from gateway.core.workers import WorkerSettings


def add_ingest_flags(flag: Callable[..., argparse.Action], workers: WorkerSettings) -> None:
    flag("--ingest-slice-ms", "INGEST_SLICE_MS", workers.ingest_slice_s * 1e3, "how long one "
         "slice of event ingest may hold the routing lock outside the C loop that decisions "
         "interrupt, in [0.1, 100] ms: a decision that arrives meanwhile waits for the rest of "
         "that part; longer slices apply more page events a second "
         "(gateway/core/ingest_slices.py)", type=finite_float(0.1, 100.0))
    flag("--ingest-priority", "INGEST_PRIORITY", "nice", "the ingest thread's priority on a "
         "busy core: nice (+10), idle (SCHED_IDLE: decisions fastest, but a busy process "
         "beside a gateway without its own cgroup stops ingest), normal "
         "(gateway/core/thread_priority.py)", choices=PRIORITIES)
    flag("--switch-interval-ms", "SWITCH_INTERVAL_MS", SWITCH_INTERVAL_S * 1e3, "the process's "
         "GIL switch interval, in [0.05, 100] ms: how long a request thread that wakes may wait "
         "for the ingest thread to hand over the GIL", type=finite_float(0.05, 100.0))


def add_index_flags(flag: Callable[..., None], cfg: GatewayConfig) -> None:
    """--index-backend and the shared index's Redis (gateway/core/index_redis.py)."""
    flag("--index-backend", "INDEX_BACKEND", cfg.index_backend, "where the routing index "
         "lives: memory (this replica's own, fed by every worker's events) or redis (one index "
         "the gateway replicas share at --index-redis-url; each replica runs an indexer per "
         "worker and the holder of the worker's Redis lease writes its events)",
         choices=("memory", "redis"))
    flag("--index-redis-url", "INDEX_REDIS_URL", None, "with --index-backend redis: the Redis "
         "of the shared index: redis://[user[:password]@]HOST:PORT/DB, rediss:// for TLS, "
         "redis+cluster://HOST:PORT (rediss+cluster://) for a Redis Cluster (any node)")
    flag("--index-redis-password-file", "INDEX_REDIS_PASSWORD_FILE", None, "file holding the "
         "index Redis's (ACL) password; the user name is the URL's (redis://USER@HOST)")
    flag("--index-redis-tls-ca", "INDEX_REDIS_TLS_CA", None, "PEM CA bundle the rediss:// "
         "index Redis's certificate is verified against")
    flag("--index-redis-tls-cert", "INDEX_REDIS_TLS_CERT", None, "PEM client certificate for "
         "an index Redis that requires one (with --index-redis-tls-key)")
    flag("--index-redis-tls-key", "INDEX_REDIS_TLS_KEY", None, "PEM key of "
         "--index-redis-tls-cert")
    flag("--index-namespace", "INDEX_NAMESPACE", cfg.index_namespace, "with --index-backend "
         "redis: the key prefix of this deployment's shared index (pcx:NAMESPACE:); replicas "
         "of one fleet share it, other fleets on the same Redis need their own")
    flag("--index-checkpoint", "INDEX_CHECKPOINT", None, "with --index-backend memory: a file "
         "the routing index is written to (periodically and at a clean shutdown) and loaded "
         "from at start, so that a restart resumes each worker's event stream instead of "
         "rebuilding the index from snapshots; one of another namespace, version or hash spec, "
         "or a corrupt one, is ignored with a warning")
    flag("--index-native", "INDEX_NATIVE", "auto", "the routing index's page table, the "
         "policy's recently routed pages and its pick over many candidates in C "
         "(gateway/core/index_native.py, built with the system compiler or taken from "
         "--kernel-cache): auto = when it builds, on = refuse to start without it, off = numpy "
         "and Python dicts (same answers, slower)",
         choices=NATIVE_MODES)
    flag("--kernel-cache", "KERNEL_CACHE", None, "directory of the compiled C page table; "
         "default $XDG_CACHE_HOME/prefixcache/kernels (~/.cache/prefixcache/kernels)")
    flag("--index-checkpoint-interval-s", "INDEX_CHECKPOINT_INTERVAL_S",
         cfg.index_checkpoint_interval_s, "seconds between two index checkpoints (one is "
         "skipped when the index has not changed since the last)",
         type=finite_float(1.0, 86400.0))
