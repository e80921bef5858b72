"""Everything in this project that measures rather than serves: the benchmarks, the fleet
simulator and its trace tools, trace replay, the fault drill, the cache service's demo, and the
results pages (README.md in this folder lists them). It sits above the services: it may import
them, they never import it (tests/test_import_rules.py).

This package itself holds what they all share: the vendored Mooncake conversation trace (see
`traces/README.md` for its provenance and licence). Importing it imports nothing else."""
from pathlib import Path

TRACES = Path(__file__).resolve().parent / "traces"
# 12,031 requests of a production chat service, 512 tokens per hash id (traces/README.md).
CONVERSATION_TRACE = TRACES / "conversation_trace.jsonl"

__all__ = ["CONVERSATION_TRACE", "TRACES"]
