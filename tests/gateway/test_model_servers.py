"""Workers as InferencePool model servers, behind a real Envoy: each fake worker has a model
server beside it (`--model-server`: the gateway's OpenAI HTTP API over that worker,
gateway/core/dataplane_tenants.py, with the other workers as resume targets,
gateway/core/resume_peers.py), and the gateway's Endpoint Picker routes OpenAI HTTP to them
by prefix (gateway/epp/openai_body.py), as the Inference Extension's reference deployment routes
to vLLM pods. The official `openai` client calls Envoy."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import openai
import pytest

from gateway.core.dataplane_tenants import DataplaneTenants
from gateway.core.discovery import WorkerAddress
from gateway.core.resume_peers import ModelServerWorkers
from gateway.core.tenants import AuthError
from prefixcache_client.tokenizer import from_directory
from service_shell import REQUEST_SCOPE_METADATA_KEY, SALT_METADATA_KEY, request_scope
from service_shell.auth import DATAPLANE, GATEWAY, Identity, ServiceIdentities, token_digest
from service_shell.service_token import SERVICE_TOKEN_METADATA_KEY
from tests.cache_service.grpc_harness import running_server
from tests.gateway.conftest import BPE_TOKENIZER
from tests.gateway.envoy_proxy import running_envoy
from tests.gateway.gateway_harness import (DATAPLANE_TOKEN, EPP_CALLERS, MODEL, Caller,
                                           FakeWorker, register_pool, running_gateway, wait_until)
from tests.gateway.server_helpers import cached_on, list_workers

SCOPE_A = request_scope("tenant-a")


def dataplane_headers(token: str = DATAPLANE_TOKEN, salt: str | None = "salt-a",
                      scope: str | None = SCOPE_A) -> list[tuple[str, str]]:
    out = [(SERVICE_TOKEN_METADATA_KEY, token)] if token else []
    out += [(SALT_METADATA_KEY, salt)] if salt is not None else []
    return out + ([(REQUEST_SCOPE_METADATA_KEY, scope)] if scope else [])


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


class Relay:
    """A TCP relay standing for a pod's network: `cut()` resets every connection through it and
    refuses new ones, as when the pod (model server and engine together) is gone."""

    def __init__(self, upstream: int):
        self._upstream, self._sockets, self._lock = upstream, [], threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(("127.0.0.1", self._upstream))
            except OSError:
                return
            with self._lock:
                self._sockets += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def cut(self) -> None:
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):  # a pump already closed it
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            sock.close()


def serve_through_envoy(stack: contextlib.ExitStack, addresses: dict[str, WorkerAddress]):
    """A model server beside each worker (knowing the others as resume targets, reached
    through a `Relay`), a gateway whose Endpoint Picker routes to the model servers, and Envoy
    in front: (gateway, its caller, model servers by worker name, Envoy, relays by name)."""
    servers: dict[str, str] = {}
    relays: dict[str, Relay] = {}
    model_servers = {}
    pool = list(addresses.values())
    for name, address in addresses.items():
        ms = stack.enter_context(running_gateway(
            ModelServerWorkers(address, lambda: pool), tenants=DataplaneTenants(EPP_CALLERS),
            http_port=0, home_worker=address.compute))
        model_servers[name] = ms
        relays[name] = relay = Relay(ms.http_port)
        stack.callback(relay.cut)
        servers[address.compute] = f"127.0.0.1:{relay.port}"
    gw = stack.enter_context(running_gateway(lambda: pool, epp_port=0,
                                             epp_model_servers=lambda a: servers[a]))
    caller = Caller(gw.address)
    stack.callback(caller.close)
    wait_until(lambda: len(list_workers(caller)) == len(pool) and gw.router.ready()
               and all(m.router.ready() and len(m.router.names()) == len(pool)
                       for m in model_servers.values()), timeout_s=30)
    envoy = stack.enter_context(running_envoy(gw.epp.port, service_token=DATAPLANE_TOKEN))
    return gw, caller, model_servers, envoy, relays


@contextlib.contextmanager
def model_server_pool():
    """A cache service, two fake workers with a chat tokenizer, and `serve_through_envoy`."""
    with running_server() as cache, contextlib.ExitStack() as stack:
        workers = {name: FakeWorker(name) for name in ("w1", "w2")}
        stopped: set[str] = set()
        for w in workers.values():
            stack.callback(lambda w=w: w.name in stopped or w.stop())
            w.tokenizer = from_directory(BPE_TOKENIZER)
            register_pool(cache.core, w.name)
        cache_addr = f"127.0.0.1:{cache.port}"
        gw, caller, model_servers, envoy, relays = serve_through_envoy(
            stack, {w.name: WorkerAddress(w.address, cache_addr) for w in workers.values()})
        yield gw, cache, workers, caller, model_servers, envoy, stopped, relays


@pytest.fixture(scope="module")
def pool():
    with model_server_pool() as p:
        yield p


def client(envoy: str, key: str = "tok-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{envoy}/v1", api_key=key, max_retries=0,
                         timeout=20)


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
