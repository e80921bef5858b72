"""End to end: `python -m gateway` in front of two real tiny-hybrid workers sharing one real cache
service (two pools). Prefix affinity with real cache hits, tenant isolation, text prompts
tokenized as the workers would, a worker killed before the first token (retried on the other),
one killed mid-stream (the other goes on with the same output; with no other left, a clear
UNAVAILABLE naming it), and a gateway free of torch."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import gateway_pb2 as gpb
from prefixcache_client.compute import ComputeClient
from tests.gateway.gateway_harness import request, wait_until


def prompt(start: int, n: int = 64) -> list[int]:
    return [(start * 37 + 5 * i) % 256 for i in range(n)]


def generate(stack, tokens: list[int] | str, token: str = "tok-a",
             max_tokens: int = 4) -> pb.GenerateResponse:
    """The final message (with stats) of a Generate call through the gateway."""
    msgs = list(stack.caller.compute.Generate(request(tokens, max_tokens=max_tokens), timeout=60,
                                              metadata=stack.caller.meta(token)))
    assert msgs[-1].HasField("stats")
    return msgs


def holder(stack, tokens: list[int], token: str = "tok-a") -> tuple[str, int]:
    resp = stack.caller.gateway.RoutePreview(gpb.RoutePreviewRequest(request=request(tokens)),
                                             metadata=stack.caller.meta(token), timeout=10)
    return resp.worker, max(c.device_tokens for c in resp.candidates)


def cached(stats: pb.GenerateStats) -> int:
    return stats.cached_tokens_device + stats.cached_tokens_host + stats.cached_tokens_remote


def test_prefix_affinity_tenant_isolation_and_text_prompts(live_stacks):
    stack = live_stacks.get()
    first = generate(stack, prompt(1))[-1].stats
    assert cached(first) == 0
    # Its pages reach the gateway through the cache service's event stream.
    wait_until(lambda: holder(stack, prompt(1) + prompt(2, 8)) == (first.worker, 64),
               what="index holds the first prompt")
    second = generate(stack, prompt(1) + prompt(2, 8))[-1].stats
    assert second.worker == first.worker
    assert cached(second) == second.cached_tokens_device >= 60
    # The same prompt from another tenant matches nothing, wherever it goes.
    assert holder(stack, prompt(1), "tok-b")[1] == 0
    assert cached(generate(stack, prompt(1), "tok-b")[-1].stats) == 0
    # A text prompt: the gateway's ids (BOS + bytes) are the worker's own.
    text = "the gateway tokenizes text exactly as the worker does"
    via_gateway = generate(stack, text, max_tokens=6)
    with ComputeClient(stack.worker_address("w1")) as direct:
        alone = direct.generate(text, pb.SamplingParams(max_tokens=6, ignore_eos=True)).result()
    assert via_gateway[-1].stats.prompt_tokens == alone.stats.prompt_tokens == len(text) + 1
    assert [t for m in via_gateway for t in m.token_ids] == alone.token_ids


def test_gateway_process_never_loads_torch(live_stacks):
    stack = live_stacks.get()
    maps = Path(f"/proc/{stack.gateway.pid}/maps").read_text()
    assert "python" in maps and "torch" not in maps


def test_a_stream_whose_worker_is_killed_goes_on_elsewhere_with_the_same_output(live_stacks):
    """SIGKILL of the worker while it streams a greedy answer: the gateway hands the request,
    with the tokens already streamed, to the other worker, and the caller gets the answer a
    worker gives alone, token for token and character for character."""
    stack = live_stacks.get()
    tokens, n = prompt(6, 32), 300
    alone = generate(stack, tokens, max_tokens=n)
    victim = alone[-1].stats.worker
    survivor = next(w for w in stack.workers if w != victim)
    wait_until(lambda: holder(stack, tokens)[0] == victim, what="index holds the prompt")
    stream = stack.caller.compute.Generate(request(tokens, max_tokens=n), timeout=60,
                                           metadata=stack.caller.meta())
    msgs = [next(stream)]
    stack.kill(victim)
    msgs += list(stream)
    assert [t for m in msgs for t in m.token_ids] == [t for m in alone for t in m.token_ids]
    assert "".join(m.text for m in msgs) == "".join(m.text for m in alone)
    assert msgs[-1].stats.worker == survivor and msgs[-1].stats.output_tokens == n
    assert stack.metric("prefixcache_gateway_resumes_total", worker=victim) == 1


def test_killed_workers_retry_before_the_first_token_and_fail_clearly_after(live_stacks):
    stack = live_stacks.get()
    tokens = prompt(3)
    victim = generate(stack, tokens)[-1].stats.worker
    survivor = next(n for n in stack.workers if n != victim)
    wait_until(lambda: holder(stack, tokens)[0] == victim, what="index holds the prompt")
    stack.kill(victim)
    # Routed to the victim (it holds the prefix), refused, retried on the survivor.
    stats = generate(stack, tokens)[-1].stats
    assert stats.worker == survivor
    assert stack.metric("prefixcache_gateway_retries_total", worker=victim) == 1
    # Now the survivor dies while streaming: the client is told, naming it.
    stream = stack.caller.compute.Generate(request(prompt(4, 16), max_tokens=1000), timeout=60,
                                           metadata=stack.caller.meta())
    assert next(stream).token_ids
    stack.kill(survivor)
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"worker {survivor}" in err.value.details() and "mid-stream" in err.value.details()
