"""What every benchmark, simulator report and replay of this project shares: the vendored
Mooncake conversation trace (see `traces/README.md` for its provenance and licence). Torch-free, so
the gateway's tools can use it."""
from pathlib import Path

TRACES = Path(__file__).resolve().parent / "traces"
# 12,031 requests of a production chat service, 512 tokens per hash id (traces/README.md).
CONVERSATION_TRACE = TRACES / "conversation_trace.jsonl"

__all__ = ["CONVERSATION_TRACE", "TRACES"]
