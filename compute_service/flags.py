"""`python -m compute_service`: serve one inference worker until SIGTERM/SIGINT, then drain and
exit 0.

Every flag falls back to an environment variable (PREFIXCACHE_*), then to a default. The first
line on stdout is `listening on HOST:PORT` (the real port when --port 0 was given): the server
answers health checks (readiness NOT_SERVING) while the model loads, and turns ready once the
model is loaded and its pool is registered with the cache service. A failed start exits 1.

--tls-cert/--tls-key make the gRPC port TLS, and --tls-ca mutual TLS; the same files secure the
channel to a remote cache service. --health-port serves health on a port of its own, plaintext
even then, for Kubernetes `grpc:` probes (which cannot present a client certificate).

L3 (Redis): --redis-url turns it on (a Redis Cluster with redis+cluster://, ACL password and TLS
files with --redis-password-file and --redis-tls-*; pages carry a MAC keyed by
--l3-mac-key-file; a Redis that does not answer at start is logged as l3_unreachable and the
worker serves without it until it does): this worker writes its pages there (--l3-write-policy,
write-through by default) and loads pages other workers wrote (--l3-lookup, on by default). The
lookup is the cache service's: with --cache-service embedded it shares this worker's Redis
client; a remote cache service needs its own --redis-url (same Redis, same key prefix), or the
worker's registration is refused and it exits 1 (pass --no-l3-lookup to only write).

Pools: --device-pages / --host-pages / --checkpoint-slots, or memory budgets (the
compute_service.sizing rules): --kv-memory-fraction F of the device memory free once the model
is loaded (CUDA), --kv-memory-bytes (any device), --host-memory-bytes; logged as
event=kv_sizing and reported by GetModelInfo.

--no-prefix-cache serves without any prefix caching (no cache service is reached, every prompt
is computed, no events): the baseline what prefix caching costs is measured against.

LoRA: --max-loaded-adapters slots (memory for --max-lora-rank reserved up front), at most
--max-loras distinct adapters per engine step; --adapter NAME=PATH (repeatable) loads PEFT
adapters at start, LoadAdapter / UnloadAdapter at run time.
"""
from __future__ import annotations

import argparse
import functools
import re

import torch

from compute_service.engine import EngineConfig
from compute_service.lora import validate_adapter_name
from compute_service.model import PRESETS
from compute_service.server import ServerConfig
from compute_service.sizing import SizingError, add_sizing_flags, check_flags, sizing_request
from compute_service.tiers import WRITE_POLICIES
from pagestore.client import L3Config
from prefixcache_client.hash import NS_DOMAIN
from service_shell import add_bool_flag, add_flag, add_server_flags, tls_from_args
from service_shell.auth_flags import (add_identities_flag, add_network_flag, add_token_flag,
                                      check_network_exposure, identities_from_args,
                                      token_from_args)
from service_shell.config import add_list_flag, add_native_flags, check_renamed
from service_shell.redis_flags import add_redis_flags, settings_from_args

EMBEDDED = "embedded"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_adapter_specs(parser: argparse.ArgumentParser, specs: list[str]) -> list[tuple[str, str]]:
    """NAME=PATH pairs, names valid and distinct."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            parser.error(f"--adapter {spec!r}: expected NAME=PATH")
        try:
            validate_adapter_name(name)
        except ValueError as exc:
            parser.error(f"--adapter {spec!r}: {exc}")
        if name in (n for n, _ in out):
            parser.error(f"--adapter {spec!r}: adapter {name!r} given twice")
        out.append((name, path))
    return out


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the worker, group by group; `declared_variables(build_parser())` lists the
    PREFIXCACHE_* variables it reads."""
    p = argparse.ArgumentParser(prog="python -m compute_service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    server, engine = ServerConfig(), EngineConfig()
    add_model_flags(p)
    add_cache_flags(p)
    add_engine_flags(p, engine)
    add_server_flags(p, env_prefix="COMPUTE", host=server.host, port=server.port,
                     max_message_mb=server.max_message_mb)
    add_drain_flags(p, server, engine)
    add_l3_flags(p, engine)
    add_lora_flags(p, engine)
    add_identities_flag(p)
    add_network_flag(p)
    add_token_flag(p, to="the cache service (--cache-service)")
    return p


def add_model_flags(p: argparse.ArgumentParser) -> None:
    flag = functools.partial(add_flag, p)
    flag("--model", "MODEL", None, f"a preset ({', '.join(PRESETS)}, byte-level tokenizer) or "
         "a directory with config.json + *.safetensors (+ tokenizer.json; without one the "
         "worker serves token-id prompts only; + generation_config.json: EOS and the sampling "
         "defaults of requests that leave them unset), a GGUF file (or a directory holding "
         "one; llama architecture, byte-level BPE tokenizer, dequantized into --dtype), or a "
         "Hugging Face hub id org/name[@revision] (from the local HF cache, else downloaded)")
    flag("--model-id", "MODEL_ID", None, "model id in cache namespaces; default: "
         "PRESET-seedSEED, or the checkpoint directory's name")
    flag("--hash-spec", "HASH_SPEC", NS_DOMAIN.decode(), "page-hash spec the deployment "
         "expects; anything but this build's is refused")
    flag("--seed", "SEED", 0, "seed of a preset's random weights", type=int)
    flag("--device", "DEVICE", "cuda" if torch.cuda.is_available() else "cpu",
         "where the model runs", choices=["cpu", "cuda"])
    flag("--dtype", "DTYPE", None, "weights and KV dtype; default bfloat16 on cuda, float32 on "
         "cpu", choices=list(_DTYPES))
    flag("--threads", "THREADS", 0, "torch CPU threads, 0 = torch's default", type=int)
    add_native_flags(p, cpu_kernels=True)


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    flag = functools.partial(add_flag, p)
    flag("--cache-service", "CACHE_SERVICE", EMBEDDED,
         f"HOST:PORT of the cache service, or '{EMBEDDED}' for an in-process one")
    add_bool_flag(p, "--prefix-cache", "PREFIX_CACHE", "prefix caching through the cache "
                  "service; --no-prefix-cache allocates pages locally and computes every prompt "
                  "(no --cache-service, host pages or L3)", "on")
    add_bool_flag(p, "--cuda-graphs", "CUDA_GRAPHS", "replay decode steps as CUDA graphs on a "
                  "GPU (attention-only models, batches without LoRA; each graph checked against "
                  "the eager forward once)", "on")
    flag("--cache-wait-s", "CACHE_WAIT_S", 60.0,
         "seconds to wait for a remote cache service at startup", type=float)
    flag("--pool-id", "POOL_ID", None, "this worker's pool id; default: HOSTNAME-PORT")


def add_engine_flags(p: argparse.ArgumentParser, engine: EngineConfig) -> None:
    flag = functools.partial(add_flag, p)
    add_sizing_flags(flag, engine)
    flag("--page-size", "PAGE_SIZE", engine.page_size, "tokens per KV page", type=int)
    flag("--token-budget", "TOKEN_BUDGET", engine.token_budget,
         "tokens computed per engine step", type=int)
    flag("--max-running", "MAX_RUNNING", engine.max_running,
         "requests running at once", type=int)
    flag("--max-context", "MAX_CONTEXT", None,
         "prompt + output tokens per request; default: the model's max positions", type=int)


def add_drain_flags(p: argparse.ArgumentParser, server: ServerConfig,
                    engine: EngineConfig) -> None:
    flag = functools.partial(add_flag, p)
    flag("--max-streams", "MAX_STREAMS", server.max_streams,
         "concurrent Generate streams", type=int)
    flag("--grace-s", "GRACE_S", server.grace_s,
         "seconds running requests get to finish on SIGTERM before they are aborted", type=float)
    flag("--drain-delay-s", "DRAIN_DELAY_S", server.drain_delay_s,
         "seconds between readiness NOT_SERVING and refusing new requests on SIGTERM",
         type=float)
    flag("--lease-ttl-s", "LEASE_TTL_S", engine.lease_ttl_s, "seconds a request's lease in the "
         "cache service lives without a step naming it; the engine renews leases a quarter of it "
         "after a step last named them, so the slowest engine step must take less than 3/4; "
         "0 = the cache service's default (30)", type=float)


def add_l3_flags(p: argparse.ArgumentParser, engine: EngineConfig) -> None:
    """L3 (Redis)."""
    flag = functools.partial(add_flag, p)
    l3 = L3Config(url="")
    add_redis_flags(p, "L3 page store shared by the workers", mac_key=True)
    flag("--l3-write-policy", "L3_WRITE_POLICY", None, "which pages this worker writes to L3: "
         "none, write-through (every page once published), write-back (a page when it leaves "
         "this worker's last local tier), hot (a page once hit --l3-min-hits times); default "
         "write-through "
         "with --redis-url, else none", choices=list(WRITE_POLICIES))
    flag("--l3-min-hits", "L3_MIN_HITS", engine.l3_min_hits,
         "hot policy: hits before a page is written", type=int)
    add_bool_flag(p, "--l3-lookup", "L3_LOOKUP", "the cache service probes L3 at every match "
                  "and this worker loads the pages it finds. A remote cache service needs its "
                  "own --redis-url", "on with --redis-url")
    flag("--l3-timeout-s", "L3_TIMEOUT_S", l3.timeout_s,
         "per-call Redis timeout; a slower Redis is a miss", type=float)
    # One name for the prefix in both services: a shared ConfigMap sets it once for the engine
    # and its cache sidecar, which must agree.
    check_renamed(p, "L3_PREFIX")
    flag("--l3-prefix", "L3_PREFIX", l3.prefix,
         "Redis key prefix (keys are PREFIX:MODEL_ID:PAGE_HASH); the cache service's --l3-prefix "
         "(the same variable) must be the same")
    flag("--l3-ttl-s", "L3_TTL_S", l3.ttl_s, "expiry of written pages, seconds; 0 = none "
         "(Redis's maxmemory-policy allkeys-lru still evicts)", type=int)
    flag("--l3-write-queue-mb", "L3_WRITE_QUEUE_MB", engine.l3_write_queue_bytes >> 20,
         "page bytes waiting for Redis; writes beyond it are dropped, never waited for",
         type=int)
    flag("--l3-batch-pages", "L3_BATCH_PAGES", engine.l3_batch_pages,
         "pages per Redis round trip (writes and loads)", type=int)


def add_lora_flags(p: argparse.ArgumentParser, engine: EngineConfig) -> None:
    flag = functools.partial(add_flag, p)
    flag("--max-loaded-adapters", "MAX_LOADED_ADAPTERS", engine.max_loaded_adapters,
         "LoRA adapter slots, memory reserved at start; 0 = no adapters", type=int)
    flag("--max-lora-rank", "MAX_LORA_RANK", engine.max_lora_rank,
         "largest adapter rank accepted", type=int)
    flag("--max-loras", "MAX_LORAS", engine.max_loras,
         "distinct adapters one engine step may run; requests for others wait", type=int)
    add_list_flag(p, "--adapter", "ADAPTERS", "NAME=PATH",
                  "a PEFT adapter directory to load at start under NAME")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    # One TLS config for both sides: this worker's server and its channel to the cache service.
    args.tls = tls_from_args(p, args)
    args.auth, args.service_token = identities_from_args(p, args), token_from_args(p, args)
    check_network_exposure(p, args, args.auth)
    if args.model is None:
        p.error("--model (or PREFIXCACHE_MODEL) is required")
    if args.hash_spec != NS_DOMAIN.decode():
        p.error(f"--hash-spec {args.hash_spec!r}: this worker implements "
                f"{NS_DOMAIN.decode()!r} only")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    check_l3_args(p, args)
    args.redis = settings_from_args(p, args)  # and args.l3_mac_key
    check_lora_args(p, args)
    if args.prefix_cache is None:
        args.prefix_cache = True
    if not args.prefix_cache and (args.redis_url or args.host_pages or args.host_memory_bytes):
        p.error("--no-prefix-cache: --redis-url and --host-pages / --host-memory-bytes hold "
                "cached pages; drop them")
    try:
        check_flags(sizing_request(args, max_context=1), args.device)
    except SizingError as exc:
        p.error(str(exc))
    return args


def check_l3_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills the L3 defaults that depend on --redis-url and refuses inconsistent settings."""
    has_l3 = bool(args.redis_url)
    if args.l3_write_policy is None:
        args.l3_write_policy = "write-through" if has_l3 else "none"
    if args.l3_lookup is None:
        args.l3_lookup = has_l3
    if not has_l3 and (args.l3_write_policy != "none" or args.l3_lookup):
        p.error("--l3-write-policy / --l3-lookup need --redis-url (or PREFIXCACHE_REDIS_URL)")
    if args.l3_min_hits < 1:
        p.error("--l3-min-hits: must be >= 1")
    for name in ("l3_timeout_s", "l3_write_queue_mb", "l3_batch_pages"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}: must be > 0")
    if args.l3_ttl_s < 0 or args.lease_ttl_s < 0:
        p.error("--l3-ttl-s / --lease-ttl-s: must be >= 0")
    if not re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", args.l3_prefix):
        p.error(f"--l3-prefix {args.l3_prefix!r}: 1..64 characters of [A-Za-z0-9._:-]")


def check_lora_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.adapters = parse_adapter_specs(p, args.adapter or [])
    if args.max_loaded_adapters < 0:
        p.error("--max-loaded-adapters: must be >= 0")
    if args.max_loaded_adapters and (args.max_lora_rank < 1 or args.max_loras < 1):
        p.error("--max-lora-rank / --max-loras: must be >= 1 (requests naming an adapter would "
                "never run with --max-loras 0)")
    if len(args.adapters) > args.max_loaded_adapters:
        p.error(f"--adapter: {len(args.adapters)} adapters but --max-loaded-adapters "
                f"{args.max_loaded_adapters}")
