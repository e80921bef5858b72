"""The serving engine: continuous batching, chunked prefill that skips cached prefixes, and the
cache-service protocol (one batched Step per engine step)."""
from compute_service.engine.engine import Engine, EngineConfig, EngineStats
from compute_service.engine.request import FinishReason, Output, Request, RequestStats
from compute_service.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "FinishReason", "Output", "Request",
           "RequestStats", "SamplingParams"]
