"""The batched logits processing (logits_ops.py) against a straightforward per-token reference
of vLLM's rules, the logprobs the sampler returns, min-p, and the engine streaming them."""
from __future__ import annotations

import math

import pytest
import torch

from compute_service.engine import SamplingParams
from compute_service.engine.logits_ops import bad_word_bans
from compute_service.engine.sampling import sample_batch
from tests.compute_service.engine.tiny_engine import PROMPT, generate, make

V = 12


def reference(row: list[float], p: SamplingParams, prompt: list[int], output: list[int],
              banned: tuple[int, ...]) -> list[float]:
    """vLLM's order, one token at a time: bans, logit_bias, repetition, frequency, presence."""
    row = list(row)
    for t in banned:
        row[t] = -math.inf
    for t, b in p.logit_bias.items():
        row[t] += b
    for t in range(len(row)):
        if t in prompt or t in output:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        n = output.count(t)
        row[t] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    return row


CASES = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.5),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.4),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(logit_bias={1: 2.5}, presence_penalty=-1.0, repetition_penalty=1.2),
]


@pytest.mark.parametrize("seed", range(5))
def test_batched_processing_matches_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(CASES), V, generator=g) * 3
    history = [(torch.randint(0, V, (5,), generator=g).tolist(),
                torch.randint(0, V, (int(torch.randint(0, 9, (1,), generator=g)),),
                              generator=g).tolist()) for _ in CASES]
    banned = [(), (2,), (), (0, 5), (), ()]
    got = sample_batch(logits.clone(), CASES, [None] * len(CASES), banned, history)
    for i, p in enumerate(CASES):
        want = reference(logits[i].tolist(), p, *history[i], banned[i])
        assert got.tokens[i] == max(range(V), key=want.__getitem__), (i, p)
        assert got.logprobs[i] is None


def test_penalties_change_the_greedy_choice_as_the_reference_predicts():
    logits = torch.tensor([[0.0, 4.0, 3.9, 1.0]])
    prompt, output = [0], [1, 1]
    for p, expect in [(SamplingParams(), 1), (SamplingParams(presence_penalty=0.2), 2),
                      (SamplingParams(frequency_penalty=0.06), 2),
                      (SamplingParams(frequency_penalty=0.04), 1),
                      (SamplingParams(repetition_penalty=1.1), 2),
                      (SamplingParams(logit_bias={3: 3.5}), 3)]:
        got = sample_batch(logits, [p], [None], [()], [(prompt, output)]).tokens[0]
        assert got == expect == max(range(4), key=reference(logits[0].tolist(), p, prompt,
                                                            output, ()).__getitem__), p


def test_logprobs_are_the_raw_log_softmax_and_the_model_output_is_untouched():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    before = logits.clone()
    params = [SamplingParams(logprobs=2, logit_bias={0: 10.0}), SamplingParams(logprobs=0)]
    got = sample_batch(logits, params, [None, None], [(), (0,)])
    assert torch.equal(logits, before)  # biases and bans worked on a copy
    assert got.tokens == [0, 1]
    raw = torch.log_softmax(before, -1)
    # vLLM's raw_logprobs: the model's distribution, not the biased one that was sampled.
    assert got.logprobs[0].logprob == pytest.approx(float(raw[0, 0]))
    assert got.logprobs[0].top == [(1, pytest.approx(float(raw[0, 1]))),
                                   (2, pytest.approx(float(raw[0, 2])))]
    assert got.logprobs[1].logprob == pytest.approx(float(raw[1, 1])) and got.logprobs[1].top == []


def test_min_p_drops_the_unlikely_tokens():
    logits = torch.tensor([[0.0, 3.0, 2.9, -3.0]])
    gen = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=1.0, min_p=0.5)
    draws = {sample_batch(logits, [p], [gen], [()]).tokens[0] for _ in range(300)}
    assert draws == {1, 2}


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("min_p", 1.5), ("logprobs", 21), ("logit_bias", {999: 1.0}), ("logit_bias", {1: 101.0}),
    ("bad_words", ((),)), ("bad_words", ((1, 99),)), ("bad_words", ((1,),) * 129)])
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=rf"^sampling\.{field}(\[\d+\]\.ids)?:"):
        SamplingParams(**{field: value}).validate(V)


def test_the_engine_streams_logprobs_equal_to_a_fresh_prefill():
    """Each decode step's logprob equals the one a new request computes for the same token from
    a prefill of everything before it: the logprobs are the model's, whichever path ran."""
    eng = make()
    toks, outs = generate(eng, max_tokens=6, ignore_eos=True, logprobs=3)
    lps = [lp for o in outs for lp in o.logprobs or ()]
    assert len(lps) == len(toks) == 6
    for tok, lp in zip(toks, lps):
        assert lp.top[0][0] == tok and lp.top[0][1] == pytest.approx(lp.logprob)  # greedy
    for k in (1, 4):
        again = generate(make(), prompt=PROMPT + toks[:k], max_tokens=1, ignore_eos=True,
                         logprobs=0)[1]
        assert again[0].logprobs[0].logprob == pytest.approx(lps[k].logprob, abs=1e-4)
    plain = generate(make(), max_tokens=6, ignore_eos=True)
    assert plain[0] == toks and all(o.logprobs is None for o in plain[1])


def test_bad_words_ban_the_last_token_after_the_rest_as_vllm_does():
    assert bad_word_bans([(7,), (3, 4), (1, 2, 5)], []) == [7]
    assert bad_word_bans([(7,), (3, 4), (1, 2, 5)], [9, 3]) == [7, 4]
    assert bad_word_bans([(7,), (3, 4), (1, 2, 5)], [1, 2]) == [7, 5]
    eng = make()
    free = generate(eng, max_tokens=10, ignore_eos=True)[0]
    k = next(i for i in range(1, 10) if free[i] != free[i - 1])
    pair = (free[k - 1], free[k])
    toks = generate(eng, max_tokens=10, ignore_eos=True, bad_words=(pair,))[0]
    assert toks[:k] == free[:k] and toks[k] != free[k]  # banned right after its prefix
    assert all((a, b) != pair for a, b in zip(toks, toks[1:]))
    single = generate(eng, max_tokens=10, ignore_eos=True, bad_words=((free[0],),))[0]
    assert free[0] not in single
