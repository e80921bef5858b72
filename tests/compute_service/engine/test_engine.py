"""Engine behaviour besides numerics: sampling, stop conditions, abort, streaming, validation,
the token budget and the cache protocol it speaks."""
from __future__ import annotations

import pytest
import torch

from compute_service.engine import FinishReason, SamplingParams
from compute_service.engine.detokenize import TextStream
from compute_service.engine.sampling import sample
from compute_service.model import ByteTokenizer
from prefixcache.v1 import cache_service_pb2 as pb
from tests.compute_service.engine.tiny_engine import PROMPT, generate, make


def test_greedy_is_deterministic_and_seeded_sampling_is_reproducible():
    eng = make()
    greedy = generate(eng, max_tokens=8, ignore_eos=True)[0]
    assert generate(eng, max_tokens=8, ignore_eos=True)[0] == greedy
    a = generate(eng, max_tokens=12, temperature=1.5, seed=11, ignore_eos=True)[0]
    b = generate(eng, max_tokens=12, temperature=1.5, seed=11, ignore_eos=True)[0]
    c = generate(eng, max_tokens=12, temperature=1.5, seed=12, ignore_eos=True)[0]
    assert a == b and a != c


def test_a_twin_samples_its_first_token_with_its_own_parameters():
    """Twins share the logits row, not the draw: each uses its own sampling parameters and
    generator, so a seeded twin gives what the same request gives alone; a twin that stops at
    its first token leaves the queue without ever running."""
    alone = generate(make(), max_tokens=12, temperature=1.5, seed=11, ignore_eos=True)[0]
    eng = make()
    outs: dict[str, list] = {k: [] for k in ("greedy", "seeded", "one")}
    eng.submit(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True), outs["greedy"].append)
    eng.submit(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, seed=11, ignore_eos=True),
               outs["seeded"].append)
    eng.submit(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), outs["one"].append)
    eng.run_until_idle()
    tokens = {k: [t for o in v for t in o.token_ids] for k, v in outs.items()}
    assert tokens["seeded"] == alone
    assert tokens["one"] == tokens["greedy"][:1]
    one = outs["one"][-1].stats
    assert one.first_token_from_twin and one.finish_reason is FinishReason.LENGTH
    assert one.computed_prompt_tokens == 0 and eng.stats.twin_first_tokens == 2
    assert not eng.waiting and not eng.running


def test_twins_need_the_same_namespace_and_prompt_and_can_be_turned_off():
    eng = make()
    outs: list = []
    eng.submit(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), outs.append)
    eng.submit(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), outs.append, salt="tenant-b")
    eng.submit(PROMPT + [7], SamplingParams(max_tokens=2, ignore_eos=True), outs.append)
    eng.run_until_idle()
    assert eng.stats.twin_first_tokens == 0
    assert not any(o.stats.first_token_from_twin for o in outs if o.stats)
    off = make(twin_first_tokens=False)
    for _ in range(2):
        off.submit(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), outs.append)
    off.run_until_idle()
    assert off.stats.twin_first_tokens == 0


def test_top_k_1_and_tiny_top_p_are_greedy():
    eng = make()
    greedy = generate(eng, max_tokens=6, ignore_eos=True)[0]
    assert generate(eng, max_tokens=6, temperature=2.0, top_k=1, seed=1, ignore_eos=True)[0] == greedy
    assert generate(eng, max_tokens=6, temperature=2.0, top_p=1e-6, seed=1, ignore_eos=True)[0] == greedy


def test_sampler_respects_top_k_top_p_and_bans():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [gen], [()])[0] for _ in range(200)}
    assert draws == {2, 3}
    draws = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)], [gen], [()])[0] for _ in range(200)}
    assert draws <= {2, 3} and 3 in draws
    assert sample(logits, [SamplingParams()], [None], [(3,)]) == [2]


def test_stop_tokens_min_tokens_max_tokens_and_eos():
    eng = make()
    free = generate(eng, max_tokens=10, ignore_eos=True)[0]
    stop = free[3]
    toks, outs = generate(eng, max_tokens=10, stop_token_ids=(stop,), ignore_eos=True)
    assert toks == free[:free.index(stop) + 1]  # the stop token is included, then it ends
    assert outs[-1].stats.finish_reason is FinishReason.STOP
    toks, outs = generate(eng, max_tokens=10, min_tokens=10, stop_token_ids=(stop,), ignore_eos=True)
    assert len(toks) == 10 and outs[-1].stats.finish_reason is FinishReason.LENGTH
    # The byte tokenizer's EOS ends a request unless ignore_eos; banning it until min_tokens.
    eos = ByteTokenizer().eos_token_ids[0]
    toks, outs = generate(eng, max_tokens=5, min_tokens=5)
    assert eos not in toks and len(toks) == 5


def test_streaming_text_equals_decoding_the_tokens():
    eng = make()
    toks, outs = generate(eng, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    text = "".join(o.text for o in outs)
    assert text == ByteTokenizer().decode(toks)
    assert outs[-1].stats.output_tokens == len(toks) == 12
    assert outs[-1].stats.ttft_s > 0


def test_abort_waiting_and_running_requests_frees_their_pages():
    eng = make(token_budget=8)
    outs = {"run": [], "wait": []}
    eng.submit(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), outs["run"].append, request_id="run")
    eng.step()
    eng.step()
    eng.submit(PROMPT[:3], SamplingParams(max_tokens=50, ignore_eos=True), outs["wait"].append, request_id="wait")
    assert eng.abort("run") and eng.abort("wait") and not eng.abort("nope")
    eng.run_until_idle()
    for key in outs:
        assert outs[key][-1].stats.finish_reason is FinishReason.ABORT
    stats = eng.cache.get_stats(pb.GetStatsRequest()).pools[0]
    assert stats.active_leases == 0 and stats.media[0].pinned_pages == 0


@pytest.mark.parametrize("bad,field", [
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1, 10**6]), "prompt.token_ids"),
    (dict(sampling=SamplingParams(temperature=-1)), "sampling.temperature"),
    (dict(sampling=SamplingParams(top_p=1.5)), "sampling.top_p"),
    (dict(sampling=SamplingParams(top_k=10**6)), "sampling.top_k"),
    (dict(sampling=SamplingParams(max_tokens=4, min_tokens=5)), "sampling.min_tokens"),
    (dict(sampling=SamplingParams(stop_token_ids=(10**6,))), "sampling.stop_token_ids"),
    (dict(sampling=SamplingParams(max_tokens=10**6)), "prompt"),
])
def test_bad_requests_name_the_field_and_queue_nothing(bad, field):
    eng = make()
    args = dict(prompt=PROMPT, sampling=SamplingParams())
    args.update(bad)
    with pytest.raises(ValueError, match=f"^{field}"):
        eng.submit(args["prompt"], args["sampling"], lambda o: None)
    assert not eng.has_work()


def test_unknown_adapter_is_a_lookup_error():
    with pytest.raises(LookupError, match="adapter"):
        make().submit(PROMPT, SamplingParams(), lambda o: None, adapter="nope")


def test_a_cached_prefix_is_skipped_in_one_step_whatever_its_length():
    """design.md lesson 9: with a 4-token budget, a 40-token prompt whose 36 tokens are cached still
    reaches its first token in the step after its match."""
    eng = make(token_budget=4)
    generate(eng, max_tokens=1, ignore_eos=True)
    outs = []
    eng.submit(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), outs.append)
    steps = 0
    while not outs:
        eng.step()
        steps += 1
    assert steps == 2  # match, then compute the uncached last token
    assert outs[-1].stats.cached_tokens_device == 36 and outs[-1].stats.computed_prompt_tokens == 4


def test_at_most_one_cache_step_per_engine_step_with_every_op_batched():
    eng = make(token_budget=64, max_running=4)
    calls = []
    real = eng.cache.step
    eng.cache.step = lambda req: (calls.append(req), real(req))[1]
    for i in range(4):
        eng.submit([i + 1] * 8, SamplingParams(max_tokens=3, ignore_eos=True), lambda o: None)
    eng.run_until_idle()
    assert len(calls) == eng.stats.cache_calls <= eng.stats.steps
    assert len(calls[0].matches) == 4  # all admitted in one call
    assert any(len(c.publishes) == 4 and len(c.allocations) == 4 for c in calls)
    assert any(len(c.releases) == 4 for c in calls)


def test_background_loop_serves_submissions_from_other_threads():
    import threading
    eng = make()
    eng.start()
    try:
        done = threading.Event()
        outs = []
        eng.submit(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True),
                   lambda o: (outs.append(o), o.stats and done.set()))
        assert done.wait(30)
        assert outs[-1].stats.output_tokens == 4
    finally:
        eng.stop()


def test_a_resumed_request_goes_on_after_the_output_it_is_given():
    """The output another worker streamed before it failed: this one computes it as context,
    streams only what follows (tokens and text), and counts it all as the request's output."""
    eng = make()
    whole, outs = generate(eng, max_tokens=12, ignore_eos=True)
    text = "".join(o.text for o in outs)
    got: list = []
    eng.submit(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), got.append,
               resume_output=whole[:5])
    eng.run_until_idle()
    assert [t for o in got for t in o.token_ids] == whole[5:]
    # What the first worker had streamed of its five tokens' text (an incomplete character is
    # held back), then this worker's text: together the whole text, nothing twice or missing.
    stream, tok = TextStream(), ByteTokenizer()
    before = "".join(stream.next(tok, whole[:i + 1]) for i in range(5))
    assert before + "".join(o.text for o in got) == text
    assert got[-1].stats.output_tokens == 12 and got[-1].stats.prompt_tokens == len(PROMPT)
    with pytest.raises(ValueError, match="resume_output: 12 tokens already reach max_tokens 12"):
        eng.submit(PROMPT, SamplingParams(max_tokens=12), got.append, resume_output=whole)
    with pytest.raises(ValueError, match="resume_output.ids: 999 is outside the vocabulary"):
        eng.submit(PROMPT, SamplingParams(max_tokens=12), got.append, resume_output=[999])
