"""The routing simulator and its tools, no model and no service: `trace` (Mooncake traces, read
and synthesized), `simulate` (the policies on a trace: engine, cache, report, bench), `copy_bound`
(the balanced hit ceiling), `seeds` (the goals over many synthetic seeds) and `replay` (a trace
against a live gateway or worker). Each tool runs as `python -m prefixcache_bench.sim.TOOL`."""
