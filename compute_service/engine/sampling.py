"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds.
Structured output (`Constraint`) masks the logits before `sample` (compute_service/engine/
grammar.py; ModelRunner.run applies it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           banned: list[tuple[int, ...]]) -> list[int]:
    """One token per row of `logits` [K, V] (fp32). `banned[i]` are ids that row i may not pick
    (stop tokens before min_tokens)."""
    if all(p.greedy for p in params) and not any(banned):
        # The common case (greedy, no bans): one argmax over the rows and one host read, rather
        # than one argmax and one device synchronisation per row.
        return logits.argmax(-1).tolist()
    out = []
    for row, p, gen, ban in zip(logits, params, generators, banned, strict=True):
        if ban:
            row = row.clone()
            row[list(ban)] = float("-inf")
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if p.top_k:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if 0 < p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
