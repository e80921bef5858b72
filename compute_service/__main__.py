"""`python -m compute_service`: serve one inference worker until SIGTERM/SIGINT, then drain and
exit 0. Its flags, each falling back to a PREFIXCACHE_* variable, and what they do are
compute_service/flags.py's (`--help` prints them); here: loading the model, opening the cache
service, sizing the pools, building the engine and serving.
"""
from __future__ import annotations

import argparse
import logging
import re
import socket
import sys
import time

import torch

from cache_service.embedded import CacheCore, configure_hashing
from compute_service.engine import Engine, EngineConfig
from compute_service.flags import _DTYPES, EMBEDDED, parse_args
from compute_service.kernels import cpu_native, cpu_status
from compute_service.model import (ByteTokenizer, CausalLM, SamplingDefaults, Tokenizer,
                                   build_preset, load_model, load_tokenizer,
                                   read_sampling_defaults)
from compute_service.model.gguf_checkpoint import (forget_files, gguf_tokenizer_files,
                                                   load_gguf_model)
from compute_service.model.source import resolve_model
from compute_service.model.warmup import warm_up
from compute_service.server import ComputeServer, ServerConfig
from compute_service.sizing import KvSizing, size_from_args
from pagestore.client import L3Client, L3Config
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache_client.cache import CacheClient, CacheClientError
from prefixcache_client.errors import CacheError, ErrorCode
from prefixcache_client.tokenizer import from_files
from service_shell import (ServiceShell, ShutdownSignal, TlsConfig, configure_logging, kv,
                           tracing)

log = logging.getLogger("compute_service")


def l3_client(args: argparse.Namespace) -> L3Client | None:
    if not args.redis_url:
        return None
    default = L3Config(args.redis_url)
    client = L3Client(L3Config(args.redis_url, prefix=args.l3_prefix, ttl_s=args.l3_ttl_s,
                               timeout_s=args.l3_timeout_s,
                               connect_timeout_s=max(default.connect_timeout_s, args.l3_timeout_s),
                               redis=args.redis, mac_key=args.l3_mac_key))
    # A wrong URL must show at start (logged with the cause, the l3 health name and the l3_up
    # gauge), not only as breaker events under traffic; the worker serves without L3 meanwhile.
    client.check(L3_CHECK_TIMEOUT_S)
    client.watch()
    return client


L3_CHECK_TIMEOUT_S = 1.0  # the start-up PING: short, a worker must not wait on a wrong URL


def default_pool_id(port: int) -> str:
    """HOSTNAME-PORT, reduced to the characters a pool id may hold: unique per pod, and per
    process on one host."""
    return re.sub(r"[^A-Za-z0-9._:-]", "-", f"{socket.gethostname()}-{port}")[-128:]


def load(args: argparse.Namespace) -> tuple[CausalLM, Tokenizer, str, SamplingDefaults]:
    """The model, its tokenizer, its model id and its sampling defaults."""
    dtype = _DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    source = resolve_model(args.model)
    if source.kind == "preset":
        model = build_preset(args.model, args.seed, dtype, args.device)
        # The seed is part of the id: two seeds are two models and must not share cache.
        return (model, ByteTokenizer(), args.model_id or f"{args.model}-seed{args.seed}",
                SamplingDefaults())
    if source.kind == "gguf":
        model = load_gguf_model(source.path, dtype, args.device)
        files = gguf_tokenizer_files(source.path)
        tokenizer = from_files(files) if files else load_tokenizer(source.path.parent, model.config)
        forget_files()
        return model, tokenizer, args.model_id or source.name, SamplingDefaults()
    path = source.path
    model = load_model(path, dtype, args.device).eval()
    # Read before anything starts: a bad tokenizer or generation_config fails the start.
    tokenizer = load_tokenizer(path, model.config)
    defaults = read_sampling_defaults(path, model.config.vocab_size)
    return model, tokenizer, args.model_id or source.name, defaults


def open_cache(spec: str, wait_s: float, tls: TlsConfig | None,
               l3: L3Client | None = None, *,
               service_token: str | None = None) -> CacheCore | CacheClient:
    """The embedded cache service (probing `l3` for remote lookups), or a client of a remote
    one (which has its own L3 client, if any)."""
    if spec == EMBEDDED:
        return CacheCore(remote=l3)
    client = CacheClient(spec, tls=tls, service_token=service_token)
    try:
        client.wait_until_ready(wait_s)
    except CacheClientError:
        client.close()
        raise
    return client


def engine_config(args: argparse.Namespace, model: CausalLM, model_id: str, port: int,
                  l3: L3Client | None, sizing: KvSizing | None = None) -> EngineConfig:
    sizing = sizing or size_from_args(args, model)
    return EngineConfig(
        pool_id=args.pool_id or default_pool_id(port), model_id=model_id,
        page_size=args.page_size, device_pages=sizing.device_pages,
        host_pages=sizing.host_pages,
        checkpoint_slots=sizing.checkpoint_slots,
        max_running=args.max_running, token_budget=args.token_budget,
        max_context=args.max_context or model.config.max_position_embeddings,
        lease_ttl_s=args.lease_ttl_s, l3=l3, l3_write_policy=args.l3_write_policy,
        l3_min_hits=args.l3_min_hits, l3_lookup=args.l3_lookup,
        l3_write_queue_bytes=args.l3_write_queue_mb << 20, l3_batch_pages=args.l3_batch_pages,
        max_loaded_adapters=args.max_loaded_adapters, max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras, prefix_cache=args.prefix_cache,
        cuda_graphs=args.cuda_graphs is not False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    tracing.configure("prefixcache-compute", args)
    configure_hashing(args.cache_native, args.kernel_cache)
    cpu_native.configure(args.cpu_native, args.kernel_cache)
    if args.threads:
        torch.set_num_threads(args.threads)
    shutdown = ShutdownSignal(log)
    config = ServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port or None,
                          health_port=args.health_port or None, tls=args.tls, auth=args.auth,
                          max_message_mb=args.max_message_mb, max_streams=args.max_streams,
                          grace_s=args.grace_s, drain_delay_s=args.drain_delay_s)
    server = ComputeServer(config).start()
    ServiceShell.announce(server, args.host)

    cache: CacheCore | CacheClient | None = None
    engine: Engine | None = None
    try:
        model, tokenizer, model_id, defaults = load(args)
        if model.device.type == "cpu":  # builds the C kernels now, not on the first request
            log.info(kv("cpu_kernels", **cpu_status()))
            started = time.perf_counter()  # packs every projection before readiness (warmup.py)
            log.info(kv("warm_up", groups=warm_up(model),
                        seconds=round(time.perf_counter() - started, 2)))
        l3 = l3_client(args)
        if args.prefix_cache:
            cache = open_cache(args.cache_service, args.cache_wait_s, args.tls, l3,
                               service_token=args.service_token)
        try:
            engine = Engine(model, tokenizer, cache, engine_config(args, model, model_id,
                                                                   server.port, l3))
        except CacheError as exc:
            if exc.code == ErrorCode.FAILED_PRECONDITION and "remote_lookup" in exc.message:
                raise RuntimeError(
                    f"the cache service at {args.cache_service} has no L3: start it with "
                    "--redis-url (the same Redis), or start this worker with --no-l3-lookup "
                    "(L3 writes only)") from exc
            raise
        for name, path in args.adapters:
            info = engine.load_adapter(name, path)
            log.info(kv("adapter_loaded", name=name, path=path, rank=info.rank, slot=info.slot,
                        targets=",".join(info.target_modules)))
    except Exception:  # bad model or adapter, unreachable cache service, rejected pool: exit 1
        log.exception(kv("startup_failed", model=args.model, cache_service=args.cache_service))
        server.drain(grace_s=0)
        if engine is not None:
            engine.close()
        if isinstance(cache, CacheClient):
            cache.close()
        return 1
    server.attach(engine, defaults)

    def drain() -> None:
        server.drain()
        if isinstance(cache, CacheClient):
            # The cache service frees the pool now instead of waiting for its leases to
            # expire, and its subscribers (the gateway) learn that this worker is gone.
            try:
                cache.unregister_pool(cpb.UnregisterPoolRequest(pool_id=engine.cfg.pool_id,
                                                                epoch=engine.epoch))
            except CacheClientError as exc:
                log.warning(kv("unregister_failed", pool=engine.cfg.pool_id, error=exc))
            cache.close()

    return ServiceShell.serve_until_signal(shutdown, drain,
                                           grace_s=args.drain_delay_s + args.grace_s, log=log)


if __name__ == "__main__":
    sys.exit(main())
