"""Workers as InferencePool model servers, behind a real Envoy (tests/gateway/model_server_pool.py):
the data plane's tenancy, prefix routing with the official `openai` client, refusals, a drained
worker, the flags, the metrics. What a dying worker costs: test_model_server_failures.py."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from gateway.core.dataplane_tenants import DataplaneTenants
from gateway.core.discovery import WorkerAddress
from gateway.core.resume_peers import ModelServerWorkers
from gateway.core.tenants import AuthError
from prefixcache_client.tokenizer import from_directory
from service_shell import SALT_METADATA_KEY
from service_shell.auth import DATAPLANE, GATEWAY, Identity, ServiceIdentities, token_digest
from tests.cache_service.grpc_harness import running_server
from tests.gateway.conftest import BPE_TOKENIZER
from tests.gateway.gateway_harness import (DATAPLANE_TOKEN, EPP_CALLERS, MODEL, FakeWorker,
                                           register_pool, running_gateway, wait_until)
from tests.gateway.model_server_pool import SCOPE_A, client, dataplane_headers, model_server_pool
from tests.gateway.server_helpers import cached_on


def test_a_model_server_takes_only_the_data_planes_tenant():
    callers = ServiceIdentities({token_digest(DATAPLANE_TOKEN): Identity("envoy", DATAPLANE),
                                 token_digest("gateway-token-0123456789"): Identity("gw", GATEWAY)})
    tenants = DataplaneTenants(callers)
    tenant = tenants.authenticate(dataplane_headers())
    assert (tenant.salt, tenant.scope) == ("salt-a", SCOPE_A)
    assert tenants.authenticate(dataplane_headers(salt=None)).salt == ""
    for bad in (dataplane_headers(token=""),  # a tenant's own bearer is no caller here
                [("authorization", "Bearer tok-a"), *dataplane_headers(token="")],
                dataplane_headers(token="gateway-token-0123456789"),  # another role
                dataplane_headers(token="forged-token-0123456789"),
                dataplane_headers(scope=None), dataplane_headers(scope="not-a-scope"),
                dataplane_headers() + [(SALT_METADATA_KEY, "salt-b")]):
        with pytest.raises(AuthError):
            tenants.authenticate(bad)


@pytest.fixture(scope="module")
def pool():
    with model_server_pool() as p:
        yield p



def test_openai_client_through_envoy_reaches_the_worker_holding_the_prefix(pool):
    gw, cache, workers, caller, _, envoy, _, _ = pool
    tokenizer = from_directory(BPE_TOKENIZER)
    for name, text in (("w1", "the first long shared system prompt " * 4),
                       ("w2", "another quite different preamble text " * 4)):
        cached_on((gw, cache, workers, caller), name, tokenizer.text_prompt_ids(text))
        out = client(envoy).completions.create(model=MODEL, prompt=text, max_tokens=3)
        assert out.choices[0].text == "ABC"
        assert out.usage.model_extra["prefixcache"]["worker"] == name
        # The worker got the tenant's salt through the data plane, with the data plane's token.
        seen = workers[name].seen[-1]
        assert seen.salts == ["salt-a"] and seen.service_tokens == []
        streamed = client(envoy).completions.create(model=MODEL, prompt=text, max_tokens=3,
                                                    stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == "ABC"
        assert workers[name].seen[-1].request.text == "" and workers[name].seen[-1].salts == [
            "salt-a"]


def test_a_conversations_next_turn_follows_its_prefix(pool):
    envoy = pool[5]
    messages = [{"role": "system", "content": "You answer briefly. " * 8},
                {"role": "user", "content": "What is a prefix cache?"}]
    first = client(envoy).chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    worker = first.usage.model_extra["prefixcache"]["worker"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And why?"}]
    for _ in range(3):
        again = client(envoy).chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=3)
        assert again.usage.model_extra["prefixcache"]["worker"] == worker


def test_refusals_are_openai_errors(pool):
    envoy = pool[5]
    with pytest.raises(openai.AuthenticationError):
        client(envoy, "not-a-tenant").completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(envoy).completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert [m.id for m in client(envoy).models.list()] == [MODEL]


def test_a_model_server_refuses_everyone_but_the_data_plane(pool):
    model_servers = pool[4]
    base = f"http://127.0.0.1:{model_servers['w1'].http_port}"
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    # A tenant's own bearer (it could otherwise pick any salt) is refused.
    r = httpx.post(f"{base}/v1/completions", json=body,
                   headers={"authorization": "Bearer tok-a"})
    assert r.status_code == 401
    r = httpx.post(f"{base}/v1/completions", json=body, headers=dict(dataplane_headers()))
    assert r.status_code == 200, r.text


def test_a_drained_worker_fails_no_request():
    """One worker leaves as Kubernetes takes a pod away (readiness off, then it stops); the
    requests sent all along through Envoy all succeed."""
    with model_server_pool() as (gw, _, workers, _, model_servers, envoy, stopped, _):
        failures, done, stop = [], [], threading.Event()

        def send():
            c = client(envoy)
            while not stop.is_set():
                try:
                    c.completions.create(model=MODEL, prompt="a prompt to send", max_tokens=3)
                    done.append(1)
                except openai.OpenAIError as exc:
                    failures.append(repr(exc))

        threads = [threading.Thread(target=send) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: len(done) >= 10)
        workers["w2"].set_ready(False)  # the pod's readiness probe fails first
        wait_until(lambda: not gw.router.get("w2").up, what="the picker sees w2 down")
        count = len(done)
        wait_until(lambda: len(done) >= count + 10)
        model_servers["w2"].drain()
        workers["w2"].stop()
        stopped.add("w2")
        count = len(done)
        wait_until(lambda: len(done) >= count + 10)
        stop.set()
        for t in threads:
            t.join(30)
        assert failures == []
        assert len(done) >= 30


def test_the_flags(tmp_path, capsys):
    from gateway.__main__ import config_from_args, parse_args
    identities = tmp_path / "ids.json"
    identities.write_text('{"identities": [{"name": "envoy", "role": "dataplane", '
                          f'"token": "{DATAPLANE_TOKEN}"}}]}}')
    ids = f"--service-identities-file={identities}"
    server = ["--model-server", "--workers", "localhost:50052", "--http-port", "8000"]
    config = config_from_args(parse_args([*server, ids]))
    assert isinstance(config.tenants, DataplaneTenants) and config.epp_model_servers is None
    for extra, why in (([], "needs --service-identities-file"),
                       ([ids, "--allow-anonymous"], "drop --tenants-file"),
                       ([ids, "--workers", "a:1,b:1"], "serves one worker"),
                       ([ids, "--epp-port", "9002"], "the picker runs in the gateway")):
        with pytest.raises(SystemExit):
            parse_args([*server, *extra])
        assert why in capsys.readouterr().err, why
    assert config.home_worker is None  # no peers: its one worker, as before
    peers = ["--resume-peers", "10.0.0.7:50052,10.0.0.8:50052@10.0.0.8:7000"]
    config = config_from_args(parse_args([*server, ids, *peers]))
    assert config.home_worker == "localhost:50052"
    assert config.workers() == [WorkerAddress("localhost:50052", "localhost:50051"),
                                WorkerAddress("10.0.0.7:50052", "10.0.0.7:50051"),
                                WorkerAddress("10.0.0.8:50052", "10.0.0.8:7000")]
    dns = config_from_args(parse_args([*server, ids, "--resume-peers-dns",
                                       "compute-headless:50052"]))
    assert dns.workers.own.compute == dns.home_worker == "localhost:50052"
    for argv, why in (([*server, ids, *peers, "--resume-peers-dns", "c:1"], "at most one"),
                      (["--workers", "a:1", "--allow-anonymous", *peers], "a model server's")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert why in capsys.readouterr().err, why
    picker = config_from_args(parse_args(["--workers", "10.0.0.7:50052", "--allow-anonymous",
                                          ids, "--epp-port", "9002",
                                          "--epp-model-server-port", "8000"]))
    assert picker.epp_model_servers("10.0.0.7:50052") == "10.0.0.7:8000"
    assert picker.epp_model_servers("[fd00::7]:50052") == "[fd00::7]:8000"


def test_a_model_server_skips_its_own_pod_among_its_peers():
    """The headless Service names this pod too, at its pod IP: that record is its own worker,
    already known at localhost, and is not a peer (its name would clash with itself)."""
    own = WorkerAddress("localhost:50052", "localhost:50051")
    answer = [WorkerAddress(f"{ip}:50052", f"{ip}:50051")
              for ip in ("10.0.0.5", "10.0.0.6", "[fd00::5]")]
    workers = ModelServerWorkers(own, lambda: answer, hosts=frozenset({"10.0.0.5", "fd00::5"}))
    assert workers() == [own, answer[1]]
    # Another port on this host is another worker (several on one machine, as in the tests).
    other = WorkerAddress("localhost:50062", "localhost:50061")
    assert ModelServerWorkers(own, lambda: [own, other], hosts=frozenset())() == [own, other]


def test_a_model_servers_metrics_carry_its_workers_vllm_names():
    """GET /metrics on a model server's port is what an InferencePool's scrapers read of a
    vLLM pod: the model server's own metrics, then its worker's (a stand-in exposition here;
    test_vllm_metrics.py checks that a real worker exports the Inference Extension's names)."""
    import http.server

    worker_text = (b'# TYPE vllm:num_requests_waiting gauge\n'
                   b'vllm:num_requests_waiting{engine="0",model_name="fake-model"} 3.0\n')

    class Worker(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(worker_text)))
            self.end_headers()
            self.wfile.write(worker_text)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Worker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with running_server() as cache:
        w = FakeWorker("w1")
        register_pool(cache.core, "w1")
        address = WorkerAddress(w.address, f"127.0.0.1:{cache.port}")
        try:
            with running_gateway(lambda: [address], tenants=DataplaneTenants(EPP_CALLERS),
                                 http_port=0, upstream_metrics_url=(
                                     f"http://127.0.0.1:{server.server_port}/metrics")) as ms:
                text = httpx.get(f"http://127.0.0.1:{ms.http_port}/metrics").text
                assert 'vllm:num_requests_waiting{engine="0",model_name="fake-model"} 3.0' in text
                assert "prefixcache_gateway_" in text  # its own first
                server.shutdown()  # the worker's endpoint gone: its own still served
                text = httpx.get(f"http://127.0.0.1:{ms.http_port}/metrics").text
                assert "prefixcache_gateway_" in text and "unavailable" in text
        finally:
            w.stop()
