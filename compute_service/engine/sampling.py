"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, per-request
seeds, after the batched logits processing of logits_ops.py (bans, logit_bias, penalties), and
the logprobs a request asked for. Structured output (`Constraint`) masks the logits after the raw
logprobs are read and before the draw (compute_service/engine/grammar.py; ModelRunner.run passes
the mask to `sample_batch`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from compute_service.engine.logits_ops import (TokenHistory, TokenLogprobs, apply_bans,
                                               apply_logit_bias, apply_penalties,
                                               gather_logprobs)

MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's and vLLM's default bound)
MAX_LOGIT_BIAS = 1024  # logit_bias entries at most
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most (OpenAI's range)
MAX_BAD_WORDS, MAX_BAD_WORD_IDS = 128, 1024  # vLLM's VLLM_MAX_NUM_BAD_WORDS, _TOTAL_TOKENS


# The kinds of structured output (the proto's StructuredOutput oneof).
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A structured-output constraint: `spec` is the JSON schema's text, the regex, the grammar,
    the choices as a JSON list, or "" for json_object. Hashable: the grammar cache's key."""
    kind: str
    spec: str = ""


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Top logprobs to return per token: None = no logprobs; 0 = the sampled token's only.
    logprobs: int | None = None
    # vLLM's bad_words, tokenized (logits_ops.bad_word_bans).
    bad_words: tuple[tuple[int, ...], ...] = ()
    constraint: Constraint | None = None

    def validate(self, vocab_size: int) -> SamplingParams:
        """Raises ValueError naming the field (the gRPC layer maps it to INVALID_ARGUMENT)."""
        if not (self.temperature == 0 or 0 < self.temperature <= 100):
            raise ValueError(f"sampling.temperature: must be 0 (greedy) or in (0, 100], got {self.temperature}")
        if not 0 <= self.top_k <= vocab_size:
            raise ValueError(f"sampling.top_k: must be in [0, {vocab_size}], got {self.top_k}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"sampling.top_p: must be in [0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens: must be >= 1, got {self.max_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"sampling.min_tokens: {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sampling.stop_token_ids: {bad[0]} is outside [0, {vocab_size})")
        self._validate_processing(vocab_size)
        return self

    def _validate_processing(self, vocab_size: int) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"sampling.{name}: must be in [-{MAX_PENALTY}, {MAX_PENALTY}], "
                                 f"got {value}")
        if not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"sampling.repetition_penalty: must be in (0, 100] (1 = off), got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"sampling.min_p: must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"sampling.logit_bias: at most {MAX_LOGIT_BIAS} entries, got "
                             f"{len(self.logit_bias)}")
        for tok, bias in self.logit_bias.items():
            if not 0 <= tok < vocab_size:
                raise ValueError(f"sampling.logit_bias: token {tok} is outside [0, {vocab_size})")
            if not -100 <= bias <= 100:
                raise ValueError(f"sampling.logit_bias: the bias of token {tok} must be in "
                                 f"[-100, 100], got {bias}")
        self._validate_bad_words(vocab_size)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"sampling.logprobs: must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.logprobs}")

    def _validate_bad_words(self, vocab_size: int) -> None:
        total = sum(len(w) for w in self.bad_words)
        if len(self.bad_words) > MAX_BAD_WORDS or total > MAX_BAD_WORD_IDS:
            raise ValueError(f"sampling.bad_words: at most {MAX_BAD_WORDS} entries and "
                             f"{MAX_BAD_WORD_IDS} ids in all, got {len(self.bad_words)} and "
                             f"{total}")
        for i, word in enumerate(self.bad_words):
            if not word:
                raise ValueError(f"sampling.bad_words[{i}].ids: must not be empty")
            bad = next((t for t in word if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"sampling.bad_words[{i}].ids: {bad} is outside "
                                 f"[0, {vocab_size})")

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class Sampled:
    tokens: list[int]
    # Per row: its TokenLogprobs, or None where the request asked for none.
    logprobs: list[TokenLogprobs | None]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[tuple[int, ...]]) -> list[int]:
    """One token per row of `logits` [K, V] (fp32). `banned[i]` are ids that row i may not pick
    (stop tokens before min_tokens). Without penalties or logprobs (see `sample_batch`)."""
    return sample_batch(logits, params, generators, banned).tokens


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None], banned: Sequence[Sequence[int]],
                 history: Sequence[TokenHistory | tuple[Sequence[int], Sequence[int]]] | None = None,
                 mask: Callable[[torch.Tensor], None] | None = None) -> Sampled:
    """The tokens of the rows of `logits` [K, V], and the logprobs rows asked for. `history[i]`
    is row i's TokenHistory, or its (prompt, output) ids; read only by rows with penalties.
    `mask` (structured output: GrammarEngine.mask) changes the logits it is given in place; it
    runs on a clone, after the raw logprobs are read and after bans, bias and penalties, before
    the draw, so the logprobs stay the model's own."""
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    # raw_logprobs (logits_ops.py): taken before anything below changes the logits.
    # (`logits` itself, not a copy, when every row asked: what follows changes a clone.)
    raw = (logits if len(lp_rows) == len(params) else logits[lp_rows]) if lp_rows else None
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    pen = [i for i, p in enumerate(params) if p.penalized]
    if any(banned) or biased or pen or mask is not None:
        logits = logits.clone()  # never change the model's output (a CUDA graph's buffer)
        apply_bans(logits, banned)
        apply_logit_bias(logits, [params[i].logit_bias if params[i].logit_bias else {}
                                  for i in range(len(params))])
        if pen:
            assert history is not None, "penalties need the rows' token history"
            apply_penalties(logits, pen, [_history(history[i]) for i in pen],
                            [params[i].repetition_penalty for i in pen],
                            [params[i].frequency_penalty for i in pen],
                            [params[i].presence_penalty for i in pen])
        if mask is not None:
            mask(logits)
    tokens = _draw(logits, params, generators)
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    if raw is not None:
        got = gather_logprobs(raw, [tokens[i] for i in lp_rows],
                              [params[i].logprobs for i in lp_rows])
        for i, g in zip(lp_rows, got, strict=True):
            logprobs[i] = g
    return Sampled(tokens, logprobs)


def _history(h: TokenHistory | tuple[Sequence[int], Sequence[int]]) -> TokenHistory:
    """A row's TokenHistory (the engine keeps one per request), or one made of (prompt, output)."""
    return h if isinstance(h, TokenHistory) else TokenHistory(h[0]).update(h[1])


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams],
          generators: Sequence[torch.Generator | None]) -> list[int]:
    if all(p.greedy for p in params):
        # The common case: one argmax over the rows and one host read, rather than one argmax
        # and one device synchronisation per row.
        return logits.argmax(-1).tolist()
    out = []
    for row, p, gen in zip(logits, params, generators, strict=True):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if p.top_k:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.min_p > 0:  # after temperature, as vLLM's min-p processor
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
            probs = probs / probs.sum()
        if 0 < p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
