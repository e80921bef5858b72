"""Structured output: the token mask of a request's constraint (a JSON schema, any JSON object, a
regex, a list of choices, an EBNF grammar), applied to the logits before sampling.

The engine is xgrammar (vLLM's default backend; docs/structured_output.md says why it over
llguidance): its compiled grammars precompute, for every parser state, which of the vocabulary's
tokens keep the output inside the language, so filling one request's mask costs microseconds.

- `check` compiles in the caller's thread at submission (Engine.submit), so an invalid schema,
  regex or grammar is refused there (ValueError naming `sampling.structured_output.<kind>`, the
  worker's INVALID_ARGUMENT, the gateway's 400), and the engine thread never compiles nor
  waits on the compile lock (a large schema takes long to compile). Compiled grammars are kept
  by constraint (an LRU of `CACHE_SIZE`): a schema sent by every request is compiled once.
- A request's matcher (`Request.matcher`) is made at submission too, advanced over the output it
  already has, so a request resumed with tokens another worker streamed (resume_output) starts
  where they left off; a preempted request keeps its output and its matcher (preemption
  recomputes the KV, not the tokens). `advance` feeds it each sampled token. n > 1 choices and
  twins are separate requests with matchers of their own.
- `mask` fills one bitmask row per constrained request of the batch (one xgrammar call over
  them all, on up to FILL_THREADS threads) and applies them in one call on the logits' device;
  unconstrained rows are not touched.
- The grammar's stop tokens are the engine's EOS ids: once the constraint is complete only EOS
  may follow, and the request ends there (Scheduler.emit). `min_tokens` and `ignore_eos` would
  forbid that EOS, leaving no token to sample: they are refused with a constraint.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from compute_service.engine.sampling import CONSTRAINT_KINDS, Constraint, SamplingParams

log = logging.getLogger("compute_service.engine.grammar")

CACHE_SIZE = 256  # compiled grammars kept (a few hundred KB each for a 150k vocabulary)
# Threads filling a step's masks: the fill runs between the forward and the sampler, when the
# engine thread's torch work is idle.
FILL_THREADS = max(1, min(4, os.cpu_count() or 1))
_FIELD = "sampling.structured_output"


def _xgr():
    """xgrammar, imported on first use: workers that never see a constraint do not load it."""
    import xgrammar
    return xgrammar


def tokenizer_info(tokenizer: Any, vocab_size: int, eos: Sequence[int]):
    """xgrammar's view of the worker's tokenizer: every token's bytes, from tokenizer.json (its
    BPE/byte-level decoding detected by xgrammar) or the presets' byte tokenizer (ids 0-255 are
    bytes). `vocab_size` is the model's (its logits may be wider than the tokenizer's)."""
    xgr = _xgr()
    files = getattr(tokenizer, "files", {}) or {}
    if "tokenizer.json" in files:
        import tokenizers
        from transformers import PreTrainedTokenizerFast

        backend = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        hf = PreTrainedTokenizerFast(tokenizer_object=backend)
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos))
    if getattr(tokenizer, "SPECIAL_TOKENS", None) is not None:  # ByteTokenizer
        # Ids from 256 are special (pad, bos, eos, unused): empty, so no text contains them
        # (xgrammar allows an empty token only as a stop token).
        vocab = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=list(eos))
    raise ValueError(f"{_FIELD}: this worker has no tokenizer (its checkpoint has no "
                     "tokenizer.json), so it cannot constrain text")


class GrammarEngine:
    def __init__(self, tokenizer: Any, vocab_size: int, eos: Sequence[int]):
        self._tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, tuple(eos)
        self._lock = threading.Lock()
        self._compiler = None  # made on first use (building the vocabulary's tables takes time)
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._bitmask: torch.Tensor | None = None
        self._batch = None  # xgrammar's BatchGrammarMatcher, made with the first mask
        self.compiled = 0  # grammars compiled (tests: once per distinct constraint)

    def check(self, sampling: SamplingParams):
        """The constraint's compiled grammar (None without one); ValueError naming the field
        when it cannot be served."""
        c = sampling.constraint
        if c is None:
            return None
        if sampling.min_tokens:
            raise ValueError("sampling.min_tokens: cannot be combined with structured_output "
                             "(the constraint decides where the output ends)")
        if sampling.ignore_eos:
            raise ValueError("sampling.ignore_eos: cannot be combined with structured_output "
                             "(the output ends at EOS once the constraint is complete)")
        return self.compile(c)

    def matcher(self, compiled, output: Sequence[int]):
        """A matcher of `compiled` advanced over `output` (a resumed request's tokens)."""
        m = _xgr().GrammarMatcher(compiled)
        for tok in output:
            m.accept_token(tok)
        return m

    def compile(self, c: Constraint):
        """The compiled grammar of `c`, from the cache or compiled now (see the module doc)."""
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                return hit
            if self._compiler is None:
                xgr = _xgr()
                info = tokenizer_info(self._tokenizer, self.vocab_size, self.eos)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            compiled = self._compile(c)
            self.compiled += 1
            self._cache[c] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, c: Constraint):
        if c.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"{_FIELD}: unknown kind {c.kind!r}")
        field = f"{_FIELD}.{c.kind}"
        comp = self._compiler
        try:
            if c.kind == "json_schema":
                # Compact JSON (", " and ": " between items, no other whitespace): with any
                # whitespace allowed, a weak or hot model can spend its whole budget on it.
                return comp.compile_json_schema(c.spec, any_whitespace=False)
            if c.kind == "json_object":
                return comp.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if c.kind == "regex":
                return comp.compile_regex(c.spec)
            if c.kind == "choice":
                return comp.compile_grammar(choice_grammar(json.loads(c.spec)))
            return comp.compile_grammar(c.spec)
        except RuntimeError as exc:  # xgrammar's parse errors: "[time] file:line: message"
            message = str(exc).strip().splitlines()[0]
            message = message.split(": ", 1)[-1] if ".cc:" in message else message
            raise ValueError(f"{field}: invalid ({message})") from None

    # ---- the engine thread ------------------------------------------------------------------

    def mask(self, logits: torch.Tensor, reqs: Sequence[Any]) -> None:
        """Sets to -inf, in place, every logit of a constrained request's row that would leave
        its constraint (row i of `logits` [K, V] is `reqs[i]`'s)."""
        rows = [i for i, r in enumerate(reqs) if r.sampling.constraint is not None]
        if not rows:
            return
        xgr = _xgr()
        if self._bitmask is None or self._bitmask.shape[0] < len(reqs):
            self._bitmask = xgr.allocate_token_bitmask(max(len(reqs), 8), self.vocab_size)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        # One call fills every constrained row (xgrammar's threads, not a Python loop).
        self._batch.batch_fill_next_token_bitmask([self._matcher(reqs[i]) for i in rows],
                                                  self._bitmask, indices=rows)
        bitmask = self._bitmask[:len(reqs)].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                        indices=rows)

    def advance(self, reqs: Sequence[Any], tokens: Sequence[int]) -> None:
        """Feeds each constrained request its sampled token."""
        for r, tok in zip(reqs, tokens, strict=True):
            m = r.matcher
            if m is not None and not m.is_terminated() and not m.accept_token(tok):
                log.warning("event=grammar_rejected_token request=%s token=%d", r.id, tok)

    def _matcher(self, r: Any):
        if r.matcher is None:  # a request made without Engine.submit (tests, benchmarks)
            r.matcher = self.matcher(self.compile(r.sampling.constraint), r.output)
        return r.matcher


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (each a literal string, written as a
    JSON string: xgrammar's EBNF literals take JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
