"""The HTTP API end to end: `python -m gateway --http-port` in front of two real tiny-hybrid
workers (live_stack.py), over raw HTTP (httpx) and the official `openai` client. Completions and
chats (a checkpoint with a ChatML template), streaming and not, cached tokens equal to what the
gRPC GenerateStats say, N samples run as twins, stop strings, adapters loaded at runtime as
models, and a preset without a chat template."""
from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache_client.tokenizer import from_directory
from tests.gateway.gateway_harness import wait_until
from tests.gateway.http_helpers import auth, post, stream, streamed_text, unique_tag
from tests.gateway.live_stack import PAGE

@pytest.fixture(scope="module")
def chat(chat_stacks):
    """The stack, its model id (the checkpoint directory's name) and its tokenizer."""
    stack = chat_stacks.get()
    return stack, Path(stack.model).name, from_directory(stack.model)


@pytest.fixture(scope="module")
def client(chat):
    stack, _, _ = chat
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="tok-a", max_retries=0,
                       timeout=60) as c:
        yield c


def text(words: int = 30) -> str:
    """A prompt no other test sends (so nothing of it is cached yet)."""
    tag = unique_tag()
    return " ".join(f"w{tag}{i % 7}" for i in range(words))


def grpc_generate(stack, prompt: str, max_tokens: int) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return list(stack.caller.compute.Generate(req, metadata=stack.caller.meta("tok-a"),
                                              timeout=60))


def test_cached_tokens_are_what_the_grpc_stats_say(chat):
    stack, model, tokenizer = chat
    prompt = text()
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    cold = post(stack.http_url, "/v1/completions", body).json()
    warm = post(stack.http_url, "/v1/completions", body).json()
    n = len(tokenizer.text_prompt_ids(prompt))
    assert cold["usage"]["prompt_tokens"] == warm["usage"]["prompt_tokens"] == n
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (n - 1) // PAGE * PAGE - PAGE and cached > 0
    ext = warm["usage"]["prefixcache"]
    assert cached == n - ext["computed_prompt_tokens"] == (
        ext["cached_tokens_device"] + ext["cached_tokens_host"] + ext["cached_tokens_remote"])
    # The same request over gRPC: the same worker, the same accounting, the same greedy text.
    msgs = grpc_generate(stack, prompt, 8)
    stats = msgs[-1].stats
    assert stats.worker == ext["worker"] and stats.prompt_tokens == n
    assert stats.prompt_tokens - stats.computed_prompt_tokens == cached
    assert (stats.cached_tokens_device + stats.cached_tokens_host + stats.cached_tokens_remote
            + stats.shared_tokens_in_flight) == cached
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"] == "".join(
        m.text for m in msgs)


def test_streamed_text_is_the_decoded_output_whole_characters_and_all(chat):
    stack, model, tokenizer = chat
    prompt = text(12)
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    evts = stream(stack.http_url, "/v1/completions", body)
    assert evts[-1] == "[DONE]"
    usage = evts[-2]["usage"]
    assert evts[-2]["choices"] == [] and usage["completion_tokens"] == 24
    streamed = streamed_text(evts, chat=False)[0]
    whole = post(stack.http_url, "/v1/completions", {**body, "stream": False}).json()
    msgs = grpc_generate(stack, prompt, 24)
    ids = [t for m in msgs for t in m.token_ids]
    # Each chunk is whole characters (the worker holds an incomplete UTF-8 sequence back), so
    # the chunks add up to the decoding of all the ids at once.
    assert streamed == whole["choices"][0]["text"] == tokenizer.decode(ids)
    assert all(e["choices"][0]["finish_reason"] in (None, "length") for e in evts[:-2])


def test_openai_client_completions_chats_models_and_errors(chat, client):
    stack, model, tokenizer = chat
    assert model in [m.id for m in client.models.list().data]
    c = client.completions.create(model=model, prompt=text(10), max_tokens=5, temperature=0)
    assert c.object == "text_completion" and c.choices[0].finish_reason in ("length", "stop")
    assert c.usage.prompt_tokens_details.cached_tokens == 0
    assert c.usage.model_extra["prefixcache"]["worker"] in stack.workers
    chunks = list(client.completions.create(model=model, prompt=text(10), max_tokens=5,
                                            stream=True, temperature=0,
                                            stream_options={"include_usage": True},
                                            # The tiny model may emit its EOS on a random
                                            # prompt; the usage count is what is checked.
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hi " + uuid.uuid4().hex[:6]}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                       temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens == len(tokenizer.chat_ids(messages))
    parts = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                                temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(p.choices[0].delta.content or "" for p in parts) == \
        r.choices[0].message.content
    # The second time, the chat's prompt comes from the cache.
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                           temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="not-a-token").models.list()
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=1, temperature="hot")
    assert err.value.body["param"] == "temperature"


def test_n_samples_of_a_prompt_run_as_twins_on_one_worker(chat):
    stack, model, _ = chat
    r = post(stack.http_url, "/v1/completions", {
        "model": model, "prompt": text(40), "n": 4, "seed": 7, "temperature": 1.0,
        "max_tokens": 6, "ignore_eos": True}).json()
    usage, choices = r["usage"], r["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    n = usage["prompt_tokens"]  # the prompt, once
    per = sorted(usage["prefixcache"]["choices"], key=lambda c: c["computed_prompt_tokens"])
    assert len({c["worker"] for c in per}) == 1
    # One sample computed the prompt; the others its last partial page at most.
    assert per[-1]["computed_prompt_tokens"] == n
    assert all(c["computed_prompt_tokens"] <= PAGE for c in per[:-1])
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["completion_tokens"] == 24
    assert len({c["text"] for c in choices}) > 1  # seed + i: four different samples


def test_stop_strings_cut_exactly_streamed_or_not(chat):
    stack, model, _ = chat
    body = {"model": model, "prompt": text(15), "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    full = post(stack.http_url, "/v1/completions", body).json()["choices"][0]["text"]
    i = len(full) // 2
    stop = full[i:i + 2]
    want = full[:full.find(stop)]
    cut = post(stack.http_url, "/v1/completions", {**body, "stop": [stop, "\x00never"]}).json()
    assert cut["choices"][0] == {"index": 0, "text": want, "logprobs": None,
                                 "finish_reason": "stop"}
    assert cut["usage"]["completion_tokens"] < 24
    evts = stream(stack.http_url, "/v1/completions", {**body, "stop": stop})
    pieces = [e["choices"][0]["text"] for e in evts[:-1]]
    assert "".join(pieces) == want and evts[-2]["choices"][0]["finish_reason"] == "stop"
    assert not any(stop in p for p in pieces)


def test_adapters_loaded_at_runtime_are_models_with_their_own_cache(chat, tmp_path):
    from compute_service.lora import write_random_adapter
    from compute_service.model import read_config

    stack, model, _ = chat
    write_random_adapter(tmp_path / "lora", read_config(stack.model), rank=8, seed=11)
    stubs = [pb_grpc.ComputeServiceStub(grpc.insecure_channel(stack.worker_address(w)))
             for w in stack.workers]
    for stub in stubs:
        stub.LoadAdapter(pb.LoadAdapterRequest(name="lora-http", path=str(tmp_path / "lora")),
                         timeout=60)
    try:
        def models() -> list[tuple[str, str | None]]:
            listed = httpx.get(stack.http_url + "/v1/models", headers=auth()).json()["data"]
            return [(m["id"], m["parent"]) for m in listed]

        wait_until(lambda: ("lora-http", model) in models(), what="adapter listed")
        prompt = text(20)
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        base = post(stack.http_url, "/v1/completions", {**body, "model": model}).json()
        lora = post(stack.http_url, "/v1/completions", {**body, "model": "lora-http"}).json()
        assert lora["model"] == "lora-http"
        assert base["usage"]["prompt_tokens"] == lora["usage"]["prompt_tokens"]
        # Another namespace: the base model's pages of this prompt are not the adapter's.
        assert lora["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = post(stack.http_url, "/v1/completions", {**body, "model": "lora-http"}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        for stub in stubs:
            stub.UnloadAdapter(pb.UnloadAdapterRequest(name="lora-http"), timeout=60)


def test_health_and_a_preset_without_a_chat_template(live_stacks):
    stack = live_stacks.get()
    assert httpx.get(stack.http_url + "/health").json() == {"status": "ready"}
    r = post(stack.http_url, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages" and "no chat template" in r.text
    # Completions work on it (the byte tokenizer: BOS + the UTF-8 bytes).
    r = post(stack.http_url, "/v1/completions", {"prompt": "héllo", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 7
