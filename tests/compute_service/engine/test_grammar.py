"""Structured output in the engine (compute_service/engine/grammar.py): the masks are xgrammar's
own matcher's, step for step; sampled outputs at temperature 1 from a random-weight model obey
their JSON schema, regex or choice through chunked prefill, preemption, twins and resumption;
a constraint is compiled once; bad constraints are refused naming the field."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from compute_service.engine import SamplingParams
from compute_service.engine.grammar import GrammarEngine, tokenizer_info
from compute_service.engine.request import Request
from compute_service.engine.sampling import Constraint
from compute_service.model import ByteTokenizer
from prefixcache_client.tokenizer import from_directory
from tests.compute_service.engine.tiny_engine import PROMPT, make

BPE = Path(__file__).resolve().parents[2] / "data" / "bpe_tokenizer"
# Not "maxLength" on a string: xgrammar 0.2.8 lets such a string hold raw control characters,
# which JSON forbids (docs/structured_output.md); a pattern bounds it instead.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}


def text_of(outs) -> str:
    return bytes(t for o in outs for t in o.token_ids if t < 256).decode("utf-8")


def schema(s=SCHEMA) -> Constraint:
    return Constraint("json_schema", json.dumps(s))


@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_masks_are_xgrammars_own_matchers_step_for_step(which):
    """Along a random walk through the schema's language, the allowed set of every step equals
    what xgrammar's GrammarMatcher over the same compiled schema allows, for the byte tokenizer
    and a byte-level BPE tokenizer.json."""
    tok = ByteTokenizer() if which == "byte" else from_directory(BPE)
    eos = tuple(tok.eos_token_ids)
    engine = GrammarEngine(tok, 320, eos)
    ref_compiler = xgr.GrammarCompiler(tokenizer_info(tok, 320, eos))
    ref = xgr.GrammarMatcher(ref_compiler.compile_json_schema(json.dumps(SCHEMA),
                                                              any_whitespace=False))
    ref_mask = xgr.allocate_token_bitmask(1, 320)
    req = Request("r", [1], SamplingParams(temperature=1.0, constraint=schema()), lambda o: None)
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        logits = torch.zeros(2, 320)  # row 0 is unconstrained: left alone
        other = Request("o", [1], SamplingParams(), lambda o: None)
        engine.mask(logits, [other, req])
        ref.fill_next_token_bitmask(ref_mask, 0)
        want = torch.zeros(1, 320)
        xgr.apply_token_bitmask_inplace(want, ref_mask)
        assert torch.equal(logits[1], want[0]) and torch.equal(logits[0], torch.zeros(320))
        allowed = torch.nonzero(logits[1] == 0).flatten()
        assert len(allowed) > 0
        pick = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        req.output.append(pick)
        engine.advance([req], [pick])
        assert ref.accept_token(pick)
        if pick in eos:
            break
    assert req.output[-1] in eos and req.matcher.is_terminated()
    body = tok.decode(req.output)
    jsonschema.validate(json.loads(body), SCHEMA)


def test_sampled_json_obeys_its_schema_through_preemption_chunks_and_twins():
    """Six requests at temperature 1 (two prompts, three choices each: twins), a small
    token budget (chunked prefill) and 30 pages (preemption): every output is JSON that
    validates against the schema, ending at EOS; the schema is compiled once."""
    eng = make(device_pages=40, token_budget=8)
    outs: dict[str, list] = {}
    for p in range(2):
        prompt = [50 + p] * 45
        for i in range(3):
            key = f"p{p}-{i}"
            outs[key] = []
            eng.submit(prompt, SamplingParams(temperature=1.0, seed=p * 10 + i, max_tokens=60,
                                              constraint=schema()),
                       outs[key].append, request_id=key)
    eng.run_until_idle()
    assert eng.stats.preemptions > 0 and eng.stats.twin_first_tokens > 0
    finished = 0
    for key, got in outs.items():
        if got[-1].stats.finish_reason.value == "stop":
            jsonschema.validate(json.loads(text_of(got)), SCHEMA)
            finished += 1
    assert finished == 6  # 60 tokens hold the schema's longest compact object
    assert eng.grammar.compiled == 1


@pytest.mark.parametrize("constraint,check", [
    (Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"),
     lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", s)),
    (Constraint("choice", json.dumps(["yes", "no", "maybe \"so\""])),
     lambda s: s in ("yes", "no", "maybe \"so\"")),
    (Constraint("json_object"), lambda s: isinstance(json.loads(s), dict)),
    (Constraint("grammar", 'root ::= "(" [a-c] [a-c]? ")"'),
     lambda s: re.fullmatch(r"\([a-c]{1,2}\)", s)),
])
def test_regex_choice_json_object_and_grammar(constraint, check):
    eng = make()
    for seed in range(3):
        outs: list = []
        eng.submit(PROMPT, SamplingParams(temperature=1.0, seed=seed, max_tokens=24,
                                          constraint=constraint), outs.append)
        eng.run_until_idle()
        if constraint.kind != "json_object":  # an object can outgrow 24 tokens
            assert outs[-1].stats.finish_reason.value == "stop"
        if outs[-1].stats.finish_reason.value == "stop":
            assert check(text_of(outs)), text_of(outs)


def test_a_resumed_request_continues_its_constraint():
    """resume_output: the matcher is advanced over the tokens another worker streamed."""
    eng = make()
    outs: list = []
    done = list(b'{"name": "ab')
    eng.submit(PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=60,
                                      constraint=schema()), outs.append, resume_output=done)
    eng.run_until_idle()
    whole = bytes(done).decode() + text_of(outs)
    jsonschema.validate(json.loads(whole), SCHEMA)
    assert json.loads(whole)["name"].startswith("ab")


@pytest.mark.parametrize("constraint,field", [
    (Constraint("regex", "([a"), "sampling.structured_output.regex: invalid"),
    (Constraint("json_schema", '{"type": 5}'), "sampling.structured_output.json_schema: invalid"),
    (Constraint("json_schema", "{not json"), "sampling.structured_output.json_schema: invalid"),
    (Constraint("grammar", "root ::= missing"), "sampling.structured_output.grammar: invalid"),
])
def test_bad_constraints_are_refused_naming_the_field(constraint, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        make().submit(PROMPT, SamplingParams(constraint=constraint), lambda o: None)


def test_min_tokens_and_ignore_eos_are_refused_with_a_constraint():
    eng = make()
    for kwargs, field in ((dict(min_tokens=2), "sampling.min_tokens"),
                          (dict(ignore_eos=True), "sampling.ignore_eos")):
        with pytest.raises(ValueError, match=field):
            eng.submit(PROMPT, SamplingParams(constraint=schema(), **kwargs), lambda o: None)
