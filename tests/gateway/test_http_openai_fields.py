"""vLLM's OpenAI fields end to end with the official `openai` client: a gateway started with
--allow-anonymous (and a tenants file) in front of two real tiny-hybrid workers with a chat
template (live_stack.py). Logprobs equal to the worker's own, penalties and logit_bias changing
the output as the reference predicts, cache_salt isolation, anonymous access with "EMPTY",
echo, the default temperature, unknown fields refused by name, and vLLM's extra endpoints."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache_client.tokenizer import from_directory
from tests.gateway.conftest import chat_checkpoint
from tests.gateway.http_helpers import post, stream, unique_tag
from tests.gateway.live_stack import LiveStacks


@pytest.fixture(scope="module")
def chat():
    stacks = LiveStacks(model=chat_checkpoint,
                        gateway_args=("--tokenizer", "{model}", "--allow-anonymous"))
    try:
        stack = stacks.get()
        yield stack, Path(stack.model).name, from_directory(stack.model)
    finally:
        stacks.close()


@pytest.fixture(scope="module")
def client(chat):
    stack, _, _ = chat
    # vLLM's documented way to call a server without --api-key.
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="EMPTY", max_retries=0,
                       timeout=60) as c:
        yield c


def text(words: int = 24) -> str:
    tag = unique_tag()
    return " ".join(f"w{tag}{i % 5}" for i in range(words))


def worker_generate(stack, worker: str, ids: list[int], **sampling) -> list[pb.GenerateResponse]:
    """The request straight to one worker (no gateway): the worker's own numbers."""
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    req.token_ids.ids.extend(ids)
    with grpc.insecure_channel(stack.worker_address(worker)) as ch:
        return list(pb_grpc.ComputeServiceStub(ch).Generate(req, timeout=60))


def test_anonymous_access_with_empty_key_and_tenants_keep_their_tokens(chat, client):
    stack, model, _ = chat
    # ignore_eos: the tiny model may emit its EOS on a random prompt; the counts are checked.
    r = client.completions.create(model=model, prompt=text(), max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text is not None and r.usage.completion_tokens == 4
    c = client.chat.completions.create(model=model, max_tokens=3, temperature=0,
                                       messages=[{"role": "user", "content": text(6)}],
                                       extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 3
    # A tenant's own token is still its tenant: its namespace is not the anonymous one.
    prompt = text()
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    post(stack.http_url, "/v1/completions", body, token="EMPTY").raise_for_status()
    tenant = post(stack.http_url, "/v1/completions", body, token="tok-a").json()
    assert tenant["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert post(stack.http_url, "/v1/completions", body, token=None).status_code == 200


def test_greedy_logprobs_sum_to_the_workers_own(chat, client):
    stack, model, tokenizer = chat
    prompt = text()
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == 8
    worker = r.usage.model_extra["prefixcache"]["worker"]
    own = worker_generate(stack, worker, tokenizer.text_prompt_ids(prompt), max_tokens=8,
                          temperature=0, ignore_eos=True, logprobs=0)
    own_lps = [e.logprob for m in own for e in m.logprobs]
    assert sum(lp.token_logprobs) == pytest.approx(sum(own_lps), abs=1e-4)
    own_ids = [t for m in own for t in m.token_ids]
    # A token's string is its own decoding (a split character's part is U+FFFD, as in vLLM).
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in own_ids]
    assert r.choices[0].text == "".join(m.text for m in own)
    for token, best in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the best is chosen
        assert max(best.values()) == pytest.approx(token) and len(best) <= 2
    # Chat, whole and streamed: the same logprobs both ways.
    messages = [{"role": "user", "content": text(8)}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3,
                                           extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True})
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs
                for c in choice.logprobs.content]
    # Equal up to float rounding: the second call reads the prompt from cache.
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    assert [c.token for c in streamed] == [c.token for c in content]
    # The tokens' bytes join into the text, a character split over two tokens included.
    # (The content skips special tokens, as vLLM's does; their logprobs are still there.)
    def special(token: str) -> bool:
        ids = tokenizer.encode(token)
        return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == ""

    joined = b"".join(bytes(c.bytes) for c in streamed if not special(c.token))
    joined = joined.decode("utf-8", errors="replace")
    assert joined == whole.choices[0].message.content


FREQ, PRES = 2.0, 2.0  # the most OpenAI allows: a repeated token loses at least 4 nats


def _reference_choice(ids: list[int], k: int, step: pb.TokenLogprobs) -> int:
    """vLLM's frequency and presence penalties on step k's top 20 raw logprobs, by token id: a
    penalized token outside the top 20 cannot win (fewer than 20 distinct tokens are penalized
    in 16 steps)."""
    counts = Counter(ids[:k])
    scored = {i: v - FREQ * counts[i] - (PRES if counts[i] else 0)
              for i, v in zip(step.top_ids, step.top_logprobs)}
    return max(scored, key=scored.get)


def test_penalties_change_the_output_as_the_reference_predicts(chat, client):
    """The first of a few fixed prompts whose greedy output the reference says the penalties
    change (a repeated token): the client's penalized output is the worker's, differs from the
    plain one at the step predicted, and every token is the reference's choice."""
    stack, model, tokenizer = chat
    worker = "w1"
    for attempt in range(10):
        prompt = f"penalty attempt {attempt}: the same words, the same words again"
        ids = tokenizer.text_prompt_ids(prompt)
        plain = worker_generate(stack, worker, ids, max_tokens=16, temperature=0,
                                ignore_eos=True, logprobs=20)
        plain_ids = [t for m in plain for t in m.token_ids]
        steps = [e for m in plain for e in m.logprobs]
        change = next((k for k in range(16)
                       if _reference_choice(plain_ids, k, steps[k]) != plain_ids[k]), None)
        if change is not None:
            break
    else:
        pytest.fail("no prompt whose greedy output repeats a token")
    r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                  frequency_penalty=FREQ, presence_penalty=PRES,
                                  extra_body={"ignore_eos": True})
    msgs = worker_generate(stack, worker, ids, max_tokens=16, temperature=0, ignore_eos=True,
                           frequency_penalty=FREQ, presence_penalty=PRES, logprobs=20)
    got = [t for m in msgs for t in m.token_ids]
    assert "".join(m.text for m in msgs) == r.choices[0].text
    assert got[:change] == plain_ids[:change] and got[change] != plain_ids[change]
    for k, step in enumerate(e for m in msgs for e in m.logprobs):
        assert got[k] == _reference_choice(got, k, step), k
    # logit_bias: one token pushed up wins every greedy step; its raw logprob shows it was not
    # the model's choice.
    target = next(t for t in got if t != got[0])
    biased = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                       logprobs=1, logit_bias={str(target): 100},
                                       extra_body={"ignore_eos": True})
    name = tokenizer.decode([target], skip_special_tokens=False)
    got = biased.choices[0].logprobs
    assert got.tokens == [name] * 4
    assert any(lp < max(top.values()) for lp, top in zip(got.token_logprobs, got.top_logprobs))


def test_cache_salt_isolates_and_is_reported(chat):
    stack, model, _ = chat
    prompt = text(40)

    def cached(salt: str | None) -> tuple[int, bool]:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        u = post(stack.http_url, "/v1/completions", body).json()["usage"]
        return u["prompt_tokens_details"]["cached_tokens"], u["prefixcache"]["cache_salt"]

    assert cached("alpha") == (0, True)
    hit, _ = cached("alpha")
    assert hit > 0  # within one salt: reused
    assert cached("beta") == (0, True)  # across salts: never
    assert cached(None) == (0, False)  # nor with the tenant's own namespace
    # Another tenant with the same cache_salt does not meet this one either.
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "cache_salt": "alpha"}
    other = post(stack.http_url, "/v1/completions", body, token="tok-b").json()["usage"]
    assert other["prompt_tokens_details"]["cached_tokens"] == 0


def test_echo_default_temperature_and_fields_refused_by_name(chat, client):
    stack, model, _ = chat
    prompt = text(6)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=3, echo=True,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith(prompt) and len(r.choices[0].text) > len(prompt)
    events = stream(stack.http_url, "/v1/completions",
                    {"model": model, "prompt": prompt, "max_tokens": 3, "echo": True,
                     "temperature": 0}, token="EMPTY")
    assert events[0]["choices"][0]["text"] == prompt
    # No temperature: vLLM's 1.0 (the checkpoint has no generation_config.json), so four
    # samples of a prompt are not four copies of the greedy answer.
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, n=4,
                                  extra_body={"ignore_eos": True})
    assert len({c.text for c in r.choices}) > 1
    for extra, param in (({"max_token": 5}, "max_token"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
                         ({"guided_json": {}}, "guided_json")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                      extra_body=extra)
        assert err.value.body["param"] == param and param in err.value.body["message"]


def test_tokenize_detokenize_version_ping_metrics(chat):
    stack, model, tokenizer = chat
    base = stack.http_url
    prompt = text(5)
    r = post(base, "/tokenize", {"model": model, "prompt": prompt, "return_token_strs": True},
             token="EMPTY").json()
    assert r["tokens"] == tokenizer.text_prompt_ids(prompt) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0 and "".join(r["token_strs"]).endswith(prompt)
    messages = [{"role": "user", "content": prompt}]
    chat_ids = post(base, "/tokenize", {"messages": messages}, token="EMPTY").json()["tokens"]
    assert chat_ids == tokenizer.chat_ids(messages, True)
    back = post(base, "/detokenize", {"model": model, "tokens": r["tokens"]}, token="EMPTY")
    assert back.json()["prompt"].endswith(prompt)
    bad = post(base, "/tokenize", {"prompt": prompt, "chat_template": "{{x}}"}, token="EMPTY")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
    assert httpx.get(base + "/version").json()["version"]
    assert httpx.get(base + "/ping").status_code == httpx.post(base + "/ping").status_code == 200
    metrics = httpx.get(base + "/metrics")
    assert metrics.status_code == 200 and "prefixcache_gateway" in metrics.text
    gone = post(base, "/v1/responses", {"model": model, "input": "hi"}, token="EMPTY")
    assert gone.status_code == 404 and "stateful" in gone.json()["error"]["message"]


def test_bad_words_are_tokenized_as_vllm_does_and_banned(chat, client):
    """A word of the greedy output, as a bad word: the output is the same up to it, then not it
    (the gateway tokenized it with the workers' tokenizer; the worker banned its token)."""
    stack, model, tokenizer = chat
    for attempt in range(10):
        prompt = f"bad words attempt {attempt}: the same words again"
        plain = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                          temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True}).choices[0]
        tokens = plain.logprobs.tokens
        # A token whose text is a word that encodes back to that one token.
        k = next((i for i, t in enumerate(tokens) if t.strip().isalpha()
                  and len(tokenizer.encode(t.strip())) == 1 and t == t.strip()), None)
        if k is not None:
            break
    else:
        pytest.fail("no greedy output with a one-token word")
    got = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                    logprobs=0, extra_body={"ignore_eos": True,
                                                            "bad_words": [tokens[k]]})
    new = got.choices[0].logprobs.tokens
    assert new[:k] == tokens[:k] and new[k] != tokens[k]
    assert tokens[k] not in new
