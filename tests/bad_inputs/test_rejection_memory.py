"""A 60 MB text prompt (the issue's) is refused by its size, at the cost of the copies gRPC and the
JSON parser make of it, not of a tokenization (which cost gigabytes). The servers run in child
processes: rejection_memory.py."""
from __future__ import annotations

import pytest

from tests.bad_inputs.rejection_memory import measure

PROMPT_BYTES = 60_000_000
# Well below what tokenizing it cost (gigabytes), with room for a few copies of the message.
MAX_GROWTH_BYTES = 400 << 20


@pytest.mark.parametrize("kind, front", [("gateway", "grpc"), ("gateway", "http"),
                                         ("compute", "grpc")])
def test_an_oversized_text_prompt_is_refused_cheaply(kind, front):
    result = measure(kind, front, PROMPT_BYTES)
    assert result["small_prompt_answer"] == "OK", result
    code = "400" if front == "http" else "INVALID_ARGUMENT"
    assert str(result["answer"]).startswith(f"{code}: prompt"), result
    assert "exceed the limit" in str(result["answer"]), result
    assert 0 <= result["peak_growth_bytes"] < MAX_GROWTH_BYTES, result
