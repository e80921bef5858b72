"""Real checkpoints served as their configs say: a checkpoint without tokenizer.json (Mamba2,
hybrid, a vocabulary too small for bytes) serves token ids and refuses text clearly; one with a
BPE tokenizer.json tokenizes with it and hands it out (GetTokenizer); EOS ids come from
config.json and generation_config.json; generation_config.json's sampling fills unset fields."""
from __future__ import annotations

import grpc
import pytest

from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.tokenizer import from_directory, from_files
from tests.compute_service.checkpoints import (BPE_TOKENIZER, preset_model, serving,
                                               write_checkpoint)
from tests.compute_service.hf_families import HF_FAMILIES, hf_checkpoint, hf_greedy, hf_model
from tests.compute_service.server_harness import fails, greedy
from tests.compute_service.paged_driver import PagedDriver

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 8
PROMPTS = [[(start * 13 + 5 * i) % 150 + 3 for i in range(11)] for start in range(12)]
SAMPLING = {"do_sample": True, "temperature": 1.5, "top_k": 40, "top_p": 0.9}


def reference(model, prompt: list[int], n: int = NEW) -> list[int]:
    return PagedDriver(model, num_pages=32, page_size=4, num_slots=2).generate_greedy(prompt, n)


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-hybrid"])
def test_checkpoint_without_tokenizer_serves_token_ids_and_refuses_text(tmp_path, preset):
    model = preset_model(preset, seed=4, vocab=200)  # < 259: no byte tokenizer could serve it
    path = write_checkpoint(tmp_path / preset, model, eos=199)
    with serving(path) as (_, client):
        info = client.model_info()
        assert (info.vocab_size, list(info.eos_token_ids)) == (200, [199])
        assert info.tokenizer_fingerprint == "" and not info.HasField("bos_token_id")
        assert not info.has_chat_template
        out = client.generate(PROMPTS[0], greedy(NEW)).result()
        assert out.token_ids == reference(model, PROMPTS[0]) and out.text == ""
        message = fails(client.generate("some text", greedy(2)), grpc.StatusCode.FAILED_PRECONDITION)
        assert message.startswith("prompt.text:") and "send token_ids" in message
        with pytest.raises(Exception, match="FAILED_PRECONDITION.*no tokenizer"):
            client.get_tokenizer()


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_a_transformers_checkpoint_is_served_over_grpc_as_transformers_generates(name):
    """Loaded as `--model DIR` loads it; four concurrent requests, three sharing a 3-page prefix
    (one of them twice), answer over gRPC with transformers' greedy tokens."""
    prompts = [PROMPTS[0] + PROMPTS[i] for i in (1, 2, 1)] + [PROMPTS[3]]
    with serving(hf_checkpoint(name)) as (_, client):
        info = client.model_info()
        assert info.architecture == hf_model(name).config.model_type
        streams = [client.generate(p, greedy(NEW)) for p in prompts]
        outs = [s.result() for s in streams]
    for p, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == hf_greedy(name, tuple(p), NEW)
    assert max(out.stats.cached_tokens_device for out in outs) > 0


def _stops(seq: list[int], eos: set[int]) -> int | None:
    return next((i for i, t in enumerate(seq) if t in eos), None)


@pytest.fixture(scope="module")
def bpe_worker(tmp_path_factory):
    """tiny-transformer weights (vocabulary 320, the BPE tokenizer's) with the BPE tokenizer,
    config.json eos a and generation_config.json eos [a, b] and sampling defaults, where a ends
    the greedy output of one prompt and b that of another."""
    model = preset_model("tiny-transformer", seed=5)
    runs = [(p, reference(model, p)) for p in PROMPTS]
    a, b, pa, pb_ = next((s1[i], s2[j], p1, p2) for p1, s1 in runs for p2, s2 in runs
                         for i in range(NEW) for j in range(NEW)
                         if s1[i] != s2[j] and _stops(s1, {s1[i], s2[j]}) == i
                         and _stops(s2, {s1[i], s2[j]}) == j)
    path = write_checkpoint(tmp_path_factory.mktemp("bpe") / "ckpt", model, bos=0, eos=a,
                            generation={"eos_token_id": [a, b], **SAMPLING},
                            tokenizer=BPE_TOKENIZER)
    with serving(path) as (server, client):
        yield model, path, client, (a, pa), (b, pb_)


def test_checkpoint_with_tokenizer_json_reports_and_hands_it_out(bpe_worker):
    _, path, client, (a, _), (b, _) = bpe_worker
    info, tok = client.model_info(), from_directory(path)
    assert info.tokenizer_fingerprint == tok.fingerprint and info.bos_token_id == 0
    assert info.has_chat_template and list(info.eos_token_ids) == [a, b]
    defaults = info.sampling_defaults
    assert (round(defaults.temperature, 4), defaults.top_k, round(defaults.top_p, 4)) == (
        1.5, 40, 0.9)
    resp = client.get_tokenizer()
    rebuilt = from_files({f.name: f.content for f in resp.files})
    assert resp.fingerprint == rebuilt.fingerprint == tok.fingerprint
    assert sorted(f.name for f in resp.files) == sorted(tok.files)


def test_text_prompts_use_the_checkpoints_tokenizer(bpe_worker):
    _, path, client, _, _ = bpe_worker
    tok = from_directory(path)
    text = "Hello world, the cache page héllo 🙂"
    ids = tok.text_prompt_ids(text)
    assert ids[0] == 0 and len(ids) < len(text.encode())  # BOS, then merged pieces
    via_text = client.generate(text, greedy(4, temperature=0)).result()
    via_ids = client.generate(ids, greedy(4, temperature=0)).result()
    assert via_text.stats.prompt_tokens == len(ids)
    assert via_text.token_ids == via_ids.token_ids
    assert via_text.text == tok.decode(via_text.token_ids)


def test_generation_stops_at_either_eos_of_generation_config(bpe_worker):
    model, _, client, (a, pa), (b, pb_) = bpe_worker
    for eos, prompt in ((a, pa), (b, pb_)):
        out = client.generate(prompt, pb.SamplingParams(max_tokens=NEW, temperature=0)).result()
        assert out.token_ids[-1] == eos and out.stats.finish_reason == pb.FINISH_REASON_STOP
        assert out.token_ids == reference(model, prompt)[:len(out.token_ids)]


def test_unset_sampling_fields_take_generation_config_and_explicit_zero_is_greedy(bpe_worker):
    model, _, client, _, _ = bpe_worker
    prompt, seeds = PROMPTS[1], range(4)
    explicit = pb.SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.5, top_k=40,
                                 top_p=0.9)
    unset = [client.generate(prompt, pb.SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                       seed=s)).result().token_ids
             for s in seeds]
    for s, tokens in zip(seeds, unset):
        sampled = pb.SamplingParams()
        sampled.CopyFrom(explicit)
        sampled.seed = s
        assert tokens == client.generate(prompt, sampled).result().token_ids
    greedy_ref = reference(model, prompt)
    assert any(tokens != greedy_ref for tokens in unset)
    zero = client.generate(prompt, greedy(NEW, temperature=0, seed=1)).result()
    assert zero.token_ids == greedy_ref
