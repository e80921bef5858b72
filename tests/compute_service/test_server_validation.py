"""The compute service's status code and named field for every bad Generate input."""
from __future__ import annotations

import math

import grpc
import pytest

from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from tests.compute_service.server_harness import (CONTEXT, VOCAB, INVALID, OUT_OF_RANGE, greedy,
                                                  wait_until)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- validation ----------------------------------------------------------------------------------

def _request(prompt_ids: list[int] | str | None = (1, 2, 3), **fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(**fields)
    if isinstance(prompt_ids, str):
        req.text = prompt_ids
    elif prompt_ids is not None:
        req.token_ids.ids.extend(prompt_ids)
    return req


@pytest.mark.parametrize("req, metadata, code, field", [
    pytest.param(_request([1, VOCAB]), (), INVALID, "prompt.token_ids", id="token-too-big"),
    pytest.param(_request([1, -1]), (), INVALID, "prompt.token_ids", id="token-negative"),
    pytest.param(_request(resume_output=pb.TokenIds(ids=[1, VOCAB])), (), INVALID,
                 "resume_output.ids", id="resumed-token-too-big"),
    pytest.param(_request(sampling=greedy(2), resume_output=pb.TokenIds(ids=[1, 2])), (),
                 INVALID, "resume_output", id="resumed-output-reaches-max-tokens"),
    pytest.param(_request(None), (), INVALID, "prompt", id="no-prompt"),
    pytest.param(_request([]), (), INVALID, "prompt", id="empty-token-ids"),
    pytest.param(_request(""), (), INVALID, "prompt", id="empty-text"),
    pytest.param(_request([1] * CONTEXT), (), OUT_OF_RANGE, "prompt", id="prompt-too-long"),
    pytest.param(_request([1] * 200, sampling=greedy(57)), (), OUT_OF_RANGE,
                 "sampling.max_tokens", id="max-tokens-too-many"),
    pytest.param(_request([1] * 250), (), OUT_OF_RANGE, "sampling.max_tokens",
                 id="default-16-does-not-fit"),
    pytest.param(_request(sampling=pb.SamplingParams(temperature=-1)), (), INVALID,
                 "sampling.temperature", id="temperature-negative"),
    pytest.param(_request(sampling=pb.SamplingParams(temperature=101)), (), INVALID,
                 "sampling.temperature", id="temperature-too-high"),
    pytest.param(_request(sampling=pb.SamplingParams(temperature=math.nan)), (), INVALID,
                 "sampling.temperature", id="temperature-nan"),
    pytest.param(_request(sampling=pb.SamplingParams(top_k=VOCAB + 1)), (), INVALID,
                 "sampling.top_k", id="top-k-over-vocab"),
    pytest.param(_request(sampling=pb.SamplingParams(top_p=1.5)), (), INVALID,
                 "sampling.top_p", id="top-p-over-1"),
    pytest.param(_request(sampling=pb.SamplingParams(max_tokens=4, min_tokens=5)), (), INVALID,
                 "sampling.min_tokens", id="min-over-max-tokens"),
    pytest.param(_request(sampling=pb.SamplingParams(min_tokens=17)), (), INVALID,
                 "sampling.min_tokens", id="min-over-default-16"),
    pytest.param(_request(sampling=pb.SamplingParams(stop_token_ids=[5, VOCAB])), (), INVALID,
                 "sampling.stop_token_ids", id="stop-token-out-of-vocab"),
    pytest.param(_request(adapter="my-lora"), (), grpc.StatusCode.NOT_FOUND, "adapter",
                 id="unknown-adapter"),
    pytest.param(_request(request_id="r" * 129), (), INVALID, "request_id",
                 id="request-id-too-long"),
    pytest.param(_request(), (("x-prefixcache-salt", "s" * 257),), INVALID,
                 "x-prefixcache-salt", id="salt-too-long"),
    pytest.param(_request(), (("x-prefixcache-salt", "a"), ("x-prefixcache-salt", "b")), INVALID,
                 "x-prefixcache-salt", id="two-salts"),
])
def test_bad_input_gets_its_code_and_names_the_field(shared, req, metadata, code, field):
    server, client = shared
    # An earlier test's request may still be retiring (its release goes out with the next step).
    wait_until(lambda: len(server.running) == 0 and not server.engine.has_work())
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            next(pb_grpc.ComputeServiceStub(ch).Generate(req, metadata=metadata, timeout=10))
    assert err.value.code() == code, err.value.details()
    assert err.value.details().startswith(f"{field}:"), err.value.details()
    assert len(server.running) == 0 and not server.engine.has_work()  # nothing was queued
