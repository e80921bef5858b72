"""Batched logits processing before sampling, in vLLM's order (vllm/v1/sample/sampler.py,
`Sampler` docstring): bans (stop tokens before min_tokens, bad words) -> logit_bias ->
repetition, frequency and presence penalties; and the logprobs a request asked for.

Every operation works on the whole batch at once, on the (row, token) pairs it touches only:
one indexed write for the bans, one `index_put_` for the biases, one gather and one scatter of
the penalized tokens (each request's distinct prompt and output ids, TokenHistory) for the
penalties; no Python loop over a row's vocabulary and no [rows, vocabulary] temporary, and rows
that ask for none of it cost nothing.

Penalties are vLLM's (vllm/model_executor/layers/utils.py `apply_penalties`):
- repetition_penalty r (1 = off) on every token of the prompt or the output: a positive logit
  is divided by r, a negative one multiplied by r;
- frequency_penalty f: the logit minus f x (times the token was generated);
- presence_penalty p: the logit minus p when the token was generated at all.
Frequency and presence count the output only; repetition counts the prompt too.

Logprobs are vLLM's default `logprobs_mode` "raw_logprobs" (vllm/config/model.py): the
log-softmax of the model's logits before any of the above, temperature included, so they are
the model's own distribution whatever the request's sampling.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's logprob and the `top` most likely tokens' (id, logprob), best first."""
    logprob: float
    top: list[tuple[int, float]]


def apply_bans(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> None:
    """Sets the banned ids of each row to -inf (in place, one indexed write)."""
    rows = [i for i, ban in enumerate(banned) for _ in ban]
    if rows:
        cols = [t for ban in banned for t in ban]
        logits[rows, cols] = float("-inf")


def bad_word_bans(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """vLLM's bad_words rule (vllm/v1/sample/ops/bad_words.py): the last id of each entry is
    banned when the output ends with the entry's other ids. Per entry, not per vocabulary id."""
    out = []
    for word in bad_words:
        n = len(word) - 1
        if n > len(output):
            continue
        if n == 0 or list(output[-n:]) == list(word[:-1]):
            out.append(word[-1])
    return out


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float]]) -> None:
    """Adds each row's {token id: bias} (in place, one accumulating indexed write)."""
    rows = [i for i, b in enumerate(biases) for _ in b]
    if not rows:
        return
    cols = [t for b in biases for t in b]
    values = torch.tensor([v for b in biases for v in b.values()], dtype=logits.dtype,
                          device=logits.device)
    idx = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    logits.index_put_(idx, values, accumulate=True)


class TokenHistory:
    """A request's tokens as the penalties read them: the prompt's distinct ids (computed once)
    and how often each id was generated (brought up to date with the output at each step, so
    a step costs the new tokens, not the whole output)."""
    __slots__ = ("prompt_ids", "counts", "_seen")

    def __init__(self, prompt: Sequence[int]) -> None:
        self.prompt_ids = np.unique(np.asarray(prompt, dtype=np.int64))
        self.counts: dict[int, int] = {}
        self._seen = 0

    def update(self, output: Sequence[int]) -> TokenHistory:
        if len(output) < self._seen:  # never shrinks in the engine; rebuilt if it did
            self.counts, self._seen = {}, 0
        for t in output[self._seen:]:
            self.counts[t] = self.counts.get(t, 0) + 1
        self._seen = len(output)
        return self


def apply_penalties(logits: torch.Tensor, rows: list[int], histories: Sequence[TokenHistory],
                    repetition: Sequence[float], frequency: Sequence[float],
                    presence: Sequence[float]) -> None:
    """vLLM's penalties (module docstring) on `rows` of `logits`, in place; `histories` and the
    penalties are per entry of `rows`. Only the (row, token) pairs a penalty touches are read
    and written (the prompt's and the output's distinct tokens: hundreds, not the vocabulary):
    one gather, the arithmetic on those values, one scatter."""
    if not rows:
        return
    r_idx, c_idx, rep, sub = [], [], [], []
    for k, (row, h) in enumerate(zip(rows, histories, strict=True)):
        out_ids = np.fromiter(h.counts, dtype=np.int64, count=len(h.counts))
        out_n = np.fromiter(h.counts.values(), dtype=np.float64, count=len(h.counts))
        ids = np.union1d(h.prompt_ids, out_ids) if repetition[k] != 1.0 else np.sort(out_ids)
        # Frequency and presence on the output's tokens, aligned with `ids` (sorted).
        minus = np.zeros(len(ids))
        if len(out_ids):
            minus[np.searchsorted(ids, out_ids)] = frequency[k] * out_n + presence[k]
        r_idx.append(np.full(len(ids), row, dtype=np.int64))
        c_idx.append(ids)
        rep.append(np.full(len(ids), repetition[k]))
        sub.append(minus)
    device, dtype = logits.device, logits.dtype
    r = torch.from_numpy(np.concatenate(r_idx)).to(device)
    c = torch.from_numpy(np.concatenate(c_idx)).to(device)
    if not len(r):
        return
    scale = torch.from_numpy(np.concatenate(rep)).to(device=device, dtype=dtype)
    minus = torch.from_numpy(np.concatenate(sub)).to(device=device, dtype=dtype)
    vals = logits[r, c]
    vals = torch.where(vals > 0, vals / scale, vals * scale) - minus
    logits[r, c] = vals


def gather_logprobs(raw: torch.Tensor, tokens: Sequence[int],
                    tops: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of `raw` logits: the log-softmax's value at the row's token and its `tops[i]`
    best. The log-softmax is never materialised: one logsumexp per row, and the top-k taken on
    the logits (the same order), each value minus its row's logsumexp; one host read."""
    raw = raw.float()
    lse = torch.logsumexp(raw, dim=-1, keepdim=True)
    idx = torch.tensor(tokens, device=raw.device).unsqueeze(1)
    chosen = (raw.gather(1, idx) - lse).squeeze(1).tolist()
    k = max(tops, default=0)
    if k:
        top_vals, top_ids = raw.topk(min(k, raw.shape[1]), dim=-1)
        top_vals, top_ids = (top_vals - lse).tolist(), top_ids.tolist()
    return [TokenLogprobs(chosen[i], list(zip(top_ids[i][:n], top_vals[i][:n])) if n else [])
            for i, n in enumerate(tops)]
