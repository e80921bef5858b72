"""The serving engine: continuous batching, chunked prefill that skips cached prefixes, and the
cache-service protocol (at most one batched Step per engine step, overlapped with the forward
where the forward needs none of its answer)."""
from compute_service.engine.engine import Engine, EngineConfig, EngineStats
from compute_service.engine.request import FinishReason, Output, Request, RequestStats
from compute_service.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "FinishReason", "Output", "Request",
           "RequestStats", "SamplingParams"]
