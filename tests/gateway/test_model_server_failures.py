"""What a dying worker costs behind Envoy (tests/gateway/model_server_pool.py): its engine dying
costs nothing (its model server resumes each stream on a peer, design.md §6 "A model server
resumes on a peer"), a seeded stream fails saying why, and the whole pod dying still cuts the
streams Envoy had started through it."""
from __future__ import annotations

import contextlib
import threading
import time

import httpx
import openai

from gateway.core.discovery import WorkerAddress
from prefixcache_client.tokenizer import from_directory
from tests.gateway.conftest import BPE_TOKENIZER
from tests.gateway.gateway_harness import MODEL, wait_until
from tests.gateway.model_server_pool import (client, dataplane_headers, model_server_pool,
                                             serve_through_envoy)
from tests.gateway.server_helpers import cached_on


def complete_stream(envoy: str, prompt: str, max_tokens: int, on_chunk=lambda: None,
                    model: str = MODEL, **extra) -> tuple[str, int, str]:
    """One greedy streamed completion through Envoy: its text, completion token count and the
    worker that finished it; `on_chunk()` after each chunk."""
    text, usage = "", None
    for chunk in client(envoy).completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **extra}):
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
        on_chunk()
    assert usage is not None
    return text, usage.completion_tokens, usage.model_extra["prefixcache"]["worker"]


def streams_cut(envoy: str, prompt: str, max_tokens: int, midway, kill, n: int = 6,
                model: str = MODEL) -> tuple[list[tuple[str, int]], list[str]]:
    """`n` concurrent streams through Envoy; `kill()` once `midway(chunks)` (chunks: how many
    each stream got so far). Their (text, tokens) and the errors their clients saw."""
    results, errors, chunks = [], [], [0] * n

    def run(i: int):
        def count():
            chunks[i] += 1
        try:
            results.append(complete_stream(envoy, prompt, max_tokens, count, model)[:2])
        except Exception as exc:  # openai's errors, or httpx's on a cut connection
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    wait_until(lambda: midway(chunks), timeout_s=30, what="streams mid-way")
    kill()
    for t in threads:
        t.join(60)
    return results, errors


def streams_cut_on(workers: dict, name: str, kill, envoy: str, prompt: str, n: int = 6):
    """`streams_cut` over fake workers: `kill()` once `name`'s worker has streamed about 10
    tokens of one of them."""
    before = len(workers[name].seen)

    def midway(_chunks) -> bool:
        if len(workers[name].seen) == before:
            return False
        time.sleep(0.3)  # about 10 of its tokens streamed
        return True

    return streams_cut(envoy, prompt, workers[name].tokens, midway, kill, n)


def test_a_workers_engine_dying_mid_stream_fails_no_request():
    """A worker's engine killed outright (OOM, a CUDA error: the model server beside it lives
    on): every stream it ran goes on on the other worker from the tokens streamed so far, with
    the tenant's salt; through Envoy, 0 requests fail, every stream has all its tokens and the
    text of an uninterrupted run; and every later request succeeds."""
    with model_server_pool() as (gw, cache, workers, caller, model_servers, envoy, stopped, _):
        for w in workers.values():
            w.tokens, w.delay_s = 40, 0.03
        text = "a prompt cached on the second worker only " * 3
        cached_on((gw, cache, workers, caller), "w2",
                  from_directory(BPE_TOKENIZER).text_prompt_ids(text))
        *reference, worker = complete_stream(envoy, text, 40)  # uninterrupted
        assert worker == "w2" and reference == ["".join(chr(65 + i) for i in range(40)), 40]
        reference = tuple(reference)

        def kill():
            workers["w2"].stop()
            stopped.add("w2")

        results, errors = streams_cut_on(workers, "w2", kill, envoy, text)
        assert errors == []  # 0 requests failed
        assert results == [reference] * 6
        resumed = [s for s in workers["w1"].seen if s.request.resume_output.ids]
        assert resumed, "no stream was cut mid-way"
        assert all(s.salts == ["salt-a"] and s.service_tokens == [] for s in resumed)
        assert all(0 < len(s.request.resume_output.ids) < 40 for s in resumed)
        registry = model_servers["w2"].metrics.registry
        assert registry.get_sample_value("prefixcache_gateway_resumes_total",
                                         {"worker": "w2"}) == len(resumed)
        # A request reaching w2's model server once its engine is known down goes to the peer
        # (the picker itself no longer sends any there).
        wait_until(lambda: not model_servers["w2"].router.get("w2").up)
        r = httpx.post(f"http://127.0.0.1:{model_servers['w2'].http_port}/v1/completions",
                       json={"model": MODEL, "prompt": text, "max_tokens": 40},
                       headers=dict(dataplane_headers()), timeout=20)
        assert r.status_code == 200 and r.json()["usage"]["prefixcache"]["worker"] == "w1"
        wait_until(lambda: not gw.router.get("w2").up, what="the picker sees w2 down")
        for _ in range(5):
            out = client(envoy).completions.create(model=MODEL, prompt=text, max_tokens=3)
            assert out.usage.model_extra["prefixcache"]["worker"] == "w1"


def test_real_engines_a_killed_one_s_streams_give_the_uninterrupted_greedy_answer(live_stacks):
    """Real tiny-hybrid workers behind their model servers, the picker and Envoy; one worker
    SIGKILLed (an engine crash: its model server lives on) while it streams greedy answers:
    each stream goes on on the other worker from the tokens streamed so far, and every client
    gets all its tokens, token for token the answer one worker gives alone."""
    live = live_stacks.get()
    cache_addr = f"127.0.0.1:{live.cache.port}"
    n, text = 160, "the model servers' peers take over a stream " * 3
    with contextlib.ExitStack() as stack:
        gw, _, model_servers, envoy, _ = serve_through_envoy(
            stack, {name: WorkerAddress(live.worker_address(name), cache_addr)
                    for name in live.workers})
        model = gw.fleet.model_id
        *reference, victim = complete_stream(envoy, text, n, model=model)
        reference = tuple(reference)
        assert reference[1] == n
        results, errors = streams_cut(envoy, text, n, lambda chunks: min(chunks) >= 2,
                                      lambda: live.kill(victim), n=4, model=model)
        assert errors == []
        assert results == [reference] * 4
        assert model_servers[victim].metrics.registry.get_sample_value(
            "prefixcache_gateway_resumes_total", {"worker": victim}) >= 1
        wait_until(lambda: not gw.router.get(victim).up, timeout_s=30,
                   what="the picker sees the killed worker down")
        assert complete_stream(envoy, text, n, model=model)[:2] == reference


def test_a_seeded_stream_is_not_resumed_and_says_why():
    """A request with a seed is not resumed on another worker (its draws there would not be
    the seed's): its stream fails, and the error names the seed."""
    with model_server_pool() as (gw, cache, workers, caller, _, envoy, stopped, _):
        w2 = workers["w2"]
        w2.tokens, w2.delay_s = 40, 0.03
        text = "a seeded prompt cached on the second worker " * 3
        cached_on((gw, cache, workers, caller), "w2",
                  from_directory(BPE_TOKENIZER).text_prompt_ids(text))
        errors = []

        def run():
            try:
                complete_stream(envoy, text, 40, seed=7)
            except openai.OpenAIError as exc:
                errors.append(str(exc))

        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: len(w2.seen) == 1)
        time.sleep(0.3)
        w2.stop()
        stopped.add("w2")
        t.join(30)
        assert len(errors) == 1 and "seed" in errors[0], errors
        assert not any(s.request.resume_output.ids for s in workers["w1"].seen)


def test_a_whole_pod_dying_cuts_the_streams_envoy_had_started():
    """What still fails: the pod itself gone (model server and engine together, its node lost).
    Envoy had sent the response headers of the streams it ran, and neither Envoy nor the
    picker can retry a started response, so their clients see an error; once the picker sees
    the worker down every request succeeds on the other."""
    with model_server_pool() as (gw, cache, workers, caller, _, envoy, stopped, relays):
        w2 = workers["w2"]
        for w in workers.values():
            w.tokens, w.delay_s = 40, 0.03
        text = "a prompt cached on the second worker only " * 3
        cached_on((gw, cache, workers, caller), "w2",
                  from_directory(BPE_TOKENIZER).text_prompt_ids(text))

        def kill():
            relays["w2"].cut()
            w2.stop()
            stopped.add("w2")

        results, errors = streams_cut_on(workers, "w2", kill, envoy, text)
        assert errors, "a stream through the dead pod should have failed"
        assert len(results) + len(errors) == 6
        wait_until(lambda: not gw.router.get("w2").up, what="the picker sees w2 down")
        for _ in range(5):
            out = client(envoy).completions.create(model=MODEL, prompt=text, max_tokens=3)
            assert out.usage.model_extra["prefixcache"]["worker"] == "w1"
