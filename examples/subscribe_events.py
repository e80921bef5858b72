"""Print the KV event stream of one worker pool, as a gateway sees it.

    .venv/bin/python examples/subscribe_events.py --cache localhost:50051 [--pool worker-0]

With service authentication on (the manifests, `python -m stack`), pass a subscriber's (or the
gateway's) token: --service-token-file FILE or PREFIXCACHE_SERVICE_TOKEN_FILE.

Without --pool it lists the pools and follows the first. The stream resumes by itself after a
broken connection (from the last seq it printed), or starts over from a snapshot when it must.
"""
from __future__ import annotations

import argparse
import os

from prefixcache.v1 import common_pb2
from prefixcache_client.cache import CacheClient
from service_shell.service_token import read_token

MEDIUM = {common_pb2.MEDIUM_DEVICE: "device", common_pb2.MEDIUM_HOST: "host",
          common_pb2.MEDIUM_REMOTE: "remote"}


def describe(batch) -> list[str]:
    lines = []
    tag = " (snapshot)" if batch.snapshot else ""
    for ev in batch.events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            s = ev.stored
            first = s.block_hashes[0].hex()[:12]
            lines.append(f"seq {batch.seq}{tag}: stored {len(s.block_hashes)} pages on {MEDIUM[s.medium]} "
                         f"from {first}… (adapter '{s.adapter}', parent {s.parent_block_hash.hex()[:12] or 'root'})")
        elif kind == "removed":
            r = ev.removed
            lines.append(f"seq {batch.seq}{tag}: removed {len(r.block_hashes)} pages from {MEDIUM[r.medium]}")
        else:
            lines.append(f"seq {batch.seq}{tag}: all blocks cleared (epoch {batch.epoch})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default="localhost:50051", help="cache service address")
    parser.add_argument("--pool", default="", help="pool id (default: the first registered)")
    parser.add_argument("--max-batches", type=int, default=0, help="stop after N batches (0 = never)")
    parser.add_argument("--service-token-file",
                        default=os.environ.get("PREFIXCACHE_SERVICE_TOKEN_FILE"),
                        help="file with a service token (role subscriber) for a cache service "
                             "with auth on (env PREFIXCACHE_SERVICE_TOKEN_FILE)")
    args = parser.parse_args()
    with CacheClient(args.cache, service_token=read_token(args.service_token_file)) as client:
        pool = args.pool or client.list_pools().pools[0].pool_id
        print(f"following pool {pool} at {args.cache}")
        seen = 0
        for item in client.subscribe(pool):
            if item.HasField("heartbeat"):
                hb = item.heartbeat
                print(f"heartbeat: head seq {hb.head_seq}, {hb.load.running_requests} running, "
                      f"{hb.load.waiting_requests} waiting")
                continue
            print("\n".join(describe(item.batch)), flush=True)
            seen += 1
            if args.max_batches and seen >= args.max_batches:
                return


if __name__ == "__main__":
    main()
