"""A table of `prefixcache_bench.sim.simulate --json` results side by side (issue 31: the same
trace at 8 workers and, scaled up with --scale-copies, at 1,000).

    python -m prefixcache_bench.sim.fleet_summary A.json B.json ... [--out summary.txt]

One row per (file, policy): workers, trace copies, requests, hit ratio and its pooled bound,
imbalance (max / mean prefill computed per worker), Router.route p50 / p99, the index's keys and
bytes per key at the end of the replay, the replay's wall time and the seconds of it spent in
Router.route and KvIndex.apply (the gateway's own code; "-" in runs from before they were
timed), and the load average the run started under; then each file's command.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from prefixcache_bench.harness import columns_table

COLUMNS = ("file", "policy", "workers", "copies", "requests", "hit_ratio", "bound_hit_ratio", "imbalance",
           "route_p50_us", "route_p99_us", "index_keys", "index_bytes_per_key", "index_mib", "wall_s", "route_s",
           "apply_s", "load_avg")


def rows(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        cfg = data["config"]
        for name, p in data["policies"].items():
            out.append({"file": Path(path).name, "policy": name, "workers": cfg["workers"],
                        "copies": cfg.get("scale_copies", 1), "requests": p["requests"],
                        "hit_ratio": round(p["hit_ratio"], 4), "bound_hit_ratio": round(data["bound_hit_ratio"], 4),
                        "imbalance": round(p["imbalance"], 3), "route_p50_us": round(p["decision_p50_us"]),
                        "route_p99_us": round(p["decision_p99_us"]), "index_keys": p["index_keys"],
                        "index_bytes_per_key": round(p["index_bytes_per_key"], 1),
                        "index_mib": round(p["index_bytes"] / 2**20, 1), "wall_s": round(p["wall_s"]),
                        "route_s": _seconds(p.get("route_total_s")), "apply_s": _seconds(p.get("index_apply_s")),
                        "load_avg": data.get("load_avg_start")})
    return out


def _seconds(value: float | None) -> int | str:
    return "-" if value is None else round(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixcache_bench.sim.fleet_summary",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="simulate --json files")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)
    commands = [json.loads(Path(p).read_text()).get("command", "?") for p in args.results]
    table = columns_table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows(args.results)])
    text = "\n".join([table, "", *commands]) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
