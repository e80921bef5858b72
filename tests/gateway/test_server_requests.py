"""Gateway requests over gRPC: auth, tokenization, deadline, cancel, Abort, worker failures."""
from __future__ import annotations

import grpc

from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.gateway_harness import request, wait_until
from tests.gateway.server_helpers import cached_on, list_workers, prompt, rpc_error, sample


# ---- requests: auth, prompts, deadline, cancel, abort ---------------------------------------

def test_auth_names_the_header(fleet):
    _, _, _, caller = fleet
    for token in (None, "nope"):
        err = rpc_error(lambda: caller.generate(prompt(5), token))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.details().startswith("authorization:")
    err = rpc_error(lambda: list_workers(caller, "nope"))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_text_prompt_is_tokenized_as_the_worker_would(fleet):
    _, _, workers, caller = fleet
    out = caller.generate("héllo")
    seen = workers[out[-1].stats.worker].seen[-1]
    assert list(seen.request.token_ids.ids) == [257, *"héllo".encode()]
    for bad, field in (([], "prompt"), ([1, -2], "prompt.token_ids")):
        err = rpc_error(lambda: caller.generate(bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith(field + ":")


def test_deadline_and_cancellation_reach_the_worker(fleet):
    _, _, workers, caller = fleet
    tokens = prompt(6)
    cached_on(fleet, "w1", tokens)
    caller.generate(tokens, timeout=4.0)
    assert 3.0 < workers["w1"].seen[-1].time_remaining < 4.5  # (gRPC rounds deadlines up)
    workers["w1"].delay_s, workers["w1"].tokens = 0.2, 50
    try:
        stream = caller.stream(tokens, request_id="cancel-me")
        next(stream)
        stream.cancel()
        seen = workers["w1"].seen[-1]
        assert seen.request.request_id == "cancel-me"
        assert seen.cancelled.wait(5)
    finally:
        workers["w1"].delay_s, workers["w1"].tokens = 0.0, 3


def test_abort_by_request_id_within_the_tenant(fleet):
    _, _, workers, caller = fleet
    tokens = prompt(7)
    cached_on(fleet, "w2", tokens)
    workers["w2"].delay_s, workers["w2"].tokens = 0.1, 20
    try:
        stream = caller.stream(tokens, request_id="job-1")
        next(stream)
        err = rpc_error(lambda: caller.generate(prompt(8), request_id="job-1"))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        abort = caller.compute.Abort
        assert not abort(pb.AbortRequest(request_id="job-1"), metadata=caller.meta("tok-b")).aborted
        assert abort(pb.AbortRequest(request_id="job-1"), metadata=caller.meta("tok-a")).aborted
        assert workers["w2"].aborted == ["job-1"]
        stream.cancel()
    finally:
        workers["w2"].delay_s, workers["w2"].tokens = 0.0, 3


# ---- failures: retry before the first token, a clear error after it ---------------------------

def test_worker_failing_before_the_first_token_is_retried_on_the_next(fleet):
    gw, _, workers, caller = fleet
    tokens = prompt(9)
    cached_on(fleet, "w1", tokens)
    workers["w1"].fail = "before"
    try:
        out = caller.generate(tokens)
    finally:
        workers["w1"].fail = ""
    assert out[-1].stats.worker == "w2"
    assert workers["w1"].seen[-1].request.request_id == workers["w2"].seen[-1].request.request_id
    assert sample(gw, "prefixcache_gateway_retries_total", worker="w1") >= 1
    # Its readiness probe (still SERVING) brings it back.
    wait_until(lambda: gw.router.get("w1").up, what="w1 up again")
    # One retry only; when it fails too, the client is told which workers failed.
    for w in workers.values():
        w.fail = "before"
    try:
        err = rpc_error(lambda: caller.generate(tokens))
    finally:
        for w in workers.values():
            w.fail = ""
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed before the first token" in err.details()
    assert "w1" in err.details() and "w2" in err.details()
    wait_until(lambda: gw.router.get("w1").up and gw.router.get("w2").up, what="both up")


def test_a_stream_whose_worker_fails_mid_stream_goes_on_elsewhere(fleet):
    """w2 dies after one token: w1 is given that token and sends the rest; one stream."""
    gw, _, workers, caller = fleet
    tokens = prompt(10)
    cached_on(fleet, "w2", tokens)
    workers["w2"].fail = "mid"
    try:
        msgs = caller.generate(tokens)
    finally:
        workers["w2"].fail = ""
    assert [t for m in msgs for t in m.token_ids] == [65, 66, 67]
    assert msgs[-1].stats.worker == "w1"
    assert list(workers["w1"].seen[-1].request.resume_output.ids) == [65]
    assert list(workers["w1"].seen[-1].request.token_ids.ids) == tokens
    assert sample(gw, "prefixcache_gateway_resumes_total", worker="w2") == 1
    assert sample(gw, "prefixcache_gateway_requests_total", worker="w2",
                  outcome="failed_mid_stream") == 0
    wait_until(lambda: gw.router.get("w2").up, what="w2 up again")


def test_a_seeded_stream_whose_worker_fails_mid_stream_is_a_clear_error(fleet):
    """Another worker's draws would not be the seed's: the caller is told instead."""
    gw, _, workers, caller = fleet
    tokens = prompt(11)
    cached_on(fleet, "w2", tokens)
    workers["w2"].fail = "mid"
    req = request(tokens)
    req.sampling.seed = 7
    seen_by_w1 = len(workers["w1"].seen)
    try:
        stream = caller.compute.Generate(req, timeout=10, metadata=caller.meta("tok-a"))
        assert next(stream).token_ids == [65]
        err = rpc_error(lambda: list(stream))
    finally:
        workers["w2"].fail = ""
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker w2" in err.details() and "mid-stream" in err.details()
    assert sample(gw, "prefixcache_gateway_requests_total", worker="w2",
                  outcome="failed_mid_stream") == 1
    assert len(workers["w1"].seen) == seen_by_w1  # nobody was asked to go on with it
    wait_until(lambda: gw.router.get("w2").up, what="w2 up again")
