"""Stream a completion from the gateway (or straight from a worker) with the Python client.

    .venv/bin/python examples/generate.py --target localhost:50050 --token demo-token-alice \\
        "Do you ship abroad?"

`python -m stack --keep-running` prints the gateway's address and the demo tokens. Straight to a
worker with service authentication on, pass an operator's or the gateway's service token:
--service-token-file FILE (or PREFIXCACHE_SERVICE_TOKEN_FILE).
"""
from __future__ import annotations

import argparse
import os
import sys

from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.compute import ComputeClient
from service_shell.service_token import read_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--target", default="localhost:50050", help="gateway or worker address")
    parser.add_argument("--token", default=None, help="bearer token (the gateway's tenants file)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--adapter", default="", help="LoRA adapter name")
    parser.add_argument("--service-token-file",
                        default=os.environ.get("PREFIXCACHE_SERVICE_TOKEN_FILE"),
                        help="service token file, for a worker with auth on (env "
                             "PREFIXCACHE_SERVICE_TOKEN_FILE)")
    args = parser.parse_args()
    with ComputeClient(args.target, auth_token=args.token,
                       service_token=read_token(args.service_token_file)) as client:
        stream = client.generate(args.prompt, pb.SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature), adapter=args.adapter)
        for msg in stream:
            sys.stdout.write(msg.text)
            sys.stdout.flush()
        s = stream.stats
        print(f"\n\n[{s.worker}] {s.prompt_tokens} prompt tokens: {s.cached_tokens_device} cached on "
              f"device, {s.cached_tokens_host} on host, {s.cached_tokens_remote} from L3, "
              f"{s.computed_prompt_tokens} computed; first token after {s.ttft_s * 1000:.0f} ms")


if __name__ == "__main__":
    main()
