"""The HTTP API over a real in-process gateway and fake workers (fast, and able to fail on cue):
auth into the gRPC tenants, what reaches the workers (ids, salts, sampling, seeds, adapters),
N samples together, stop strings with the worker call aborted, client disconnects, load
shedding and no worker as 429/503, errors inside a stream, and the drain."""
from __future__ import annotations

import threading

import grpc
import httpx
import pytest

from gateway.http.respond import default_temperature
from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.gateway_harness import MODEL, running_gateway, wait_until
from tests.gateway.http_helpers import auth, events, post, stream, streamed_text
from tests.gateway.server_helpers import fake_fleet, prompt


@pytest.fixture(scope="module")
def http_fleet():
    """`fake_fleet` with the gateway's HTTP API: (gateway, workers, addresses, base URL)."""
    with fake_fleet(http_port=0, tokenizer="byte") as (gw, _, workers, addresses, _caller):
        base = f"http://127.0.0.1:{gw.http_port}"
        wait_until(lambda: httpx.get(base + "/health").status_code == 200, what="HTTP health")
        yield gw, workers, addresses, base


@pytest.fixture
def workers(http_fleet):
    """The fake workers, restored to their defaults after the test."""
    gw, workers, _, _ = http_fleet
    yield workers
    for w in workers.values():
        w.tokens, w.delay_s, w.fail, w.adapters = 3, 0.0, "", []
        w.fail_code = grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: all(gw.router.get(n).up for n in workers), what="workers up again")


# Token ids: the fake workers have no tokenizer (text prompts are tested on the live stack).
P = [1, 2, 3, 4, 5]


def seen_for(workers, rid: str):
    """(worker name, Seen) of every call a request `rid` made."""
    return [(name, s) for name, w in workers.items() for s in list(w.seen)
            if s.request.request_id.startswith(rid + "-")]


def test_tenants_and_salts_are_the_grpc_ones(http_fleet, workers):
    _, _, _, base = http_fleet
    for token in (None, "nope"):
        r = post(base, "/v1/completions", {"prompt": P}, token)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["message"].startswith("authorization:")
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": [7, 8, 9, 10, 11, 12, 13],
                                       "max_tokens": 3}, "tok-b")
    assert r.status_code == 200, r.text
    body = r.json()
    [(_, seen)] = seen_for(workers, body["id"])
    assert seen.salts == ["salt-b"]
    assert list(seen.request.token_ids.ids) == [7, 8, 9, 10, 11, 12, 13]
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "ABC", "logprobs": None,
                                "finish_reason": "length"}]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (7, 3, 10)
    assert usage["prefixcache"]["worker"] in workers


def test_n_samples_go_to_one_worker_together_with_their_own_seeds(http_fleet, workers):
    _, _, _, base = http_fleet
    r = post(base, "/v1/completions", {
        "prompt": prompt(40), "n": 3, "seed": 10, "temperature": 0.5, "top_p": 0.9,
        "top_k": -1, "max_tokens": 3, "ignore_eos": True, "stop_token_ids": [5],
        "min_tokens": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    usage = body["usage"]
    assert usage["prompt_tokens"] == 64 and usage["completion_tokens"] == 9  # prompt once
    calls = seen_for(workers, body["id"])
    assert len({name for name, _ in calls}) == 1 and len(calls) == 3
    assert sorted(s.request.sampling.seed for _, s in calls) == [10, 11, 12]
    sp = calls[0][1].request.sampling
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    assert sp.HasField("top_k") and sp.top_k == 0 and sp.max_tokens == 3 and sp.ignore_eos
    assert list(sp.stop_token_ids) == [5] and sp.min_tokens == 1
    assert {c["worker"] for c in usage["prefixcache"]["choices"]} == {calls[0][0]}
    # A batch: choice index = prompt * n + sample, each prompt counted once.
    r = post(base, "/v1/completions", {"prompt": [[1, 2], [3, 4, 5]], "n": 2, "max_tokens": 1})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert r.json()["usage"]["prompt_tokens"] == 5
    r = post(base, "/v1/completions", {"prompt": [[1]] * 3, "n": 50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    # Unset sampling fields stay unset (the worker applies the checkpoint's defaults), but an
    # omitted temperature is vLLM's 1.0 when the model names none (these workers' do not).
    r = post(base, "/v1/completions", {"prompt": [1, 2, 3]})
    [(_, s)] = seen_for(workers, r.json()["id"])
    assert s.request.sampling.temperature == 1.0 and s.request.sampling.max_tokens == 16
    assert not s.request.sampling.HasField("top_p") and not s.request.sampling.HasField("top_k")


def test_an_omitted_temperature_is_the_models_default_else_one():
    """vLLM's rule: generation_config.json's temperature (left unset for the worker to apply)
    when the model has one, else 1.0."""
    class Fleet:
        info = None

    class Proxy:
        fleet = Fleet()

    assert default_temperature(Proxy()) == 1.0
    Fleet.info = pb.GetModelInfoResponse()
    assert default_temperature(Proxy()) == 1.0
    Fleet.info = pb.GetModelInfoResponse(sampling_defaults=pb.SamplingParams(temperature=0.7))
    assert default_temperature(Proxy()) is None
    Fleet.info = pb.GetModelInfoResponse(sampling_defaults=pb.SamplingParams(temperature=0.0))
    assert default_temperature(Proxy()) is None  # do_sample: false, greedy by default


def test_stop_strings_cut_the_output_and_abort_the_worker_call(http_fleet, workers):
    _, _, _, base = http_fleet
    for w in workers.values():
        w.tokens = 6  # "ABCDEF", one letter a message
    r = post(base, "/v1/completions", {"prompt": P, "stop": ["CD", "zz"]})
    body = r.json()
    assert body["choices"][0]["text"] == "AB" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 4  # up to the token completing the stop
    [(name, _)] = seen_for(workers, body["id"])
    assert workers[name].aborted[-1] == f"{body['id']}-0"
    evts = stream(base, "/v1/completions", {"prompt": P, "stop": "CD"})
    assert evts[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in evts[:-1]]
    assert "".join(texts) == "AB" and not any("C" in t for t in texts)
    assert evts[-2]["choices"][0]["finish_reason"] == "stop"


def test_a_client_that_leaves_cancels_its_worker_calls(http_fleet, workers):
    _, _, _, base = http_fleet
    for w in workers.values():
        w.tokens, w.delay_s = 200, 0.05
    with httpx.stream("POST", base + "/v1/completions", headers=auth(), timeout=30,
                      json={"prompt": P, "stream": True, "max_tokens": 200}) as r:
        first = events([next(r.iter_lines())])[0]
    [(_, seen)] = seen_for(workers, first["id"])
    assert seen.cancelled.wait(5), "the worker call was not cancelled"
    before = {n: len(w.seen) for n, w in workers.items()}
    with pytest.raises(httpx.ReadTimeout):
        post(base, "/v1/completions", {"prompt": P, "max_tokens": 200}, timeout=0.5)
    new = [s for n, w in workers.items() for s in list(w.seen)[before[n]:]]
    assert len(new) == 1 and new[0].cancelled.wait(5)


def test_chat_needs_the_workers_tokenizer(http_fleet):
    _, _, _, base = http_fleet
    r = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    # Here because no worker has the gateway's tokenizer; on workers that share it, because it
    # has no template (test_http_live.py).
    assert r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("code,status", [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                                         (grpc.StatusCode.UNAVAILABLE, 503)])
def test_every_worker_shedding_load_or_down(http_fleet, workers, code, status):
    _, _, _, base = http_fleet
    for w in workers.values():
        w.fail, w.fail_code = "before", code
    for body in ({"prompt": P}, {"prompt": P, "stream": True}):
        r = post(base, "/v1/completions", body)
        assert r.status_code == status, r.text
        assert "failed before the first token" in r.json()["error"]["message"]


def test_a_failure_mid_stream_is_an_error_event_or_a_503(http_fleet, workers):
    """Both workers fail mid-stream: the stream moves once (the second worker goes on after
    the first's token) and then fails, as an error event or a 503."""
    gw, _, _, base = http_fleet
    for w in workers.values():
        w.fail = "mid"
    evts = stream(base, "/v1/completions", {"prompt": P})
    assert "".join(e["choices"][0]["text"] for e in evts[:2]) == "AB"
    assert "mid-stream" in evts[-2]["error"]["message"] and evts[-1] == "[DONE]"
    wait_until(lambda: all(gw.router.get(n).up for n in workers), what="both workers up")
    r = post(base, "/v1/completions", {"prompt": P})
    assert r.status_code == 503 and "mid-stream" in r.json()["error"]["message"]


def test_adapters_are_models_and_route_in_their_namespace(http_fleet, workers):
    _, _, _, base = http_fleet
    # An unknown name refreshes the catalog now; an adapter loaded right after is still found
    # (the next refresh waits out its rate limit instead of refusing the name).
    r = post(base, "/v1/completions", {"model": "lora-a", "prompt": P})
    assert r.status_code == 404 and "does not exist" in r.text
    for w in workers.values():
        w.adapters = ["lora-a"]  # "loaded at runtime": the next request naming it sees it
    r = post(base, "/v1/completions", {"model": "lora-a", "prompt": P})
    assert r.status_code == 200, r.text
    [(_, seen)] = seen_for(workers, r.json()["id"])
    assert seen.request.adapter == "lora-a" and r.json()["model"] == "lora-a"
    models = httpx.get(base + "/v1/models", headers=auth()).json()
    assert models["object"] == "list"
    assert [(m["id"], m["parent"]) for m in models["data"]] == [(MODEL, None),
                                                                ("lora-a", MODEL)]
    r = post(base, "/v1/completions", {"model": "lora-b", "prompt": P})
    assert r.status_code == 404
    assert r.json()["error"] | {"message": ""} == {
        "message": "", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}
    assert httpx.get(base + "/v1/models").status_code == 401


def test_no_worker_is_503(http_fleet):
    with running_gateway(lambda: [], http_port=0) as empty:
        base = f"http://127.0.0.1:{empty.http_port}"
        assert httpx.get(base + "/health").status_code == 503
        for r in (post(base, "/v1/completions", {"prompt": P}),
                  httpx.get(base + "/v1/models", headers=auth())):
            assert r.status_code == 503 and "no worker" in r.json()["error"]["message"]


def refused(base: str) -> bool:
    try:
        httpx.get(base + "/health", timeout=2)
    except httpx.TransportError:
        return True
    return False


def test_drain_lets_running_streams_finish_and_takes_no_new_ones(http_fleet, workers):
    _, _, addresses, _ = http_fleet
    for w in workers.values():
        w.tokens, w.delay_s = 10, 0.1
    with running_gateway(lambda: addresses, http_port=0, grace_s=10.0,
                         tokenizer="byte") as gw:
        base = f"http://127.0.0.1:{gw.http_port}"
        wait_until(lambda: httpx.get(base + "/health").status_code == 200, what="ready")
        got: list = []
        first = threading.Event()

        def read() -> None:
            with httpx.stream("POST", base + "/v1/completions", headers=auth(), timeout=30,
                              json={"prompt": P, "stream": True}) as r:
                for line in r.iter_lines():
                    got.extend(events([line]))
                    first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(10)
        drain = threading.Thread(target=gw.drain)
        drain.start()
        wait_until(lambda: refused(base), what="the HTTP listener closed")
        reader.join(20)
        drain.join(20)
        assert not drain.is_alive()
    assert got[-1] == "[DONE]"
    assert streamed_text(got, chat=False) == {0: "ABCDEFGHIJ"}


def test_with_tls_the_http_api_serves_tls_with_the_grpc_certificate(tmp_path):
    import ssl

    from service_shell import TlsConfig
    from tests.service_shell.certs import make_pki

    pki = make_pki(tmp_path)
    tls = TlsConfig(cert=pki.server.cert, key=pki.server.key, ca=pki.ca)
    with running_gateway(lambda: [], http_port=0, tls=tls) as gw:
        url = f"https://127.0.0.1:{gw.http_port}/health"
        ctx = ssl.create_default_context(cafile=pki.ca)
        ctx.load_cert_chain(pki.client.cert, pki.client.key)
        assert httpx.get(url, verify=ctx).status_code == 503  # served; no worker yet
        with pytest.raises(httpx.TransportError):  # mTLS: no client certificate, no answer
            httpx.get(url, verify=ssl.create_default_context(cafile=pki.ca))
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{gw.http_port}/health")
