"""Batched logits processing before sampling, in vLLM's order (vllm/v1/sample/sampler.py,
`Sampler` docstring): bans (stop tokens before min_tokens, bad words) -> logit_bias ->
repetition, frequency and presence penalties; and the logprobs a request asked for.

Every operation works on the whole batch at once: the rows that need it are gathered, processed
as one tensor and written back (one scatter for the bans, one `index_put_` for the biases, one
bin count of the padded token histories for the penalties); no Python loop over a row's
vocabulary, and rows that ask for none of it cost nothing.

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


def _padded(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), max(width, 1)), pad, dtype=torch.int64)
    for i, s in enumerate(seqs):
        if s:
            out[i, :len(s)] = torch.as_tensor(s, dtype=torch.int64)
    return out.to(device)


def _counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] how often each id occurs in each row's sequence (pad = vocab, dropped)."""
    ids = _padded(seqs, vocab, device)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: list[int], prompts: Sequence[Sequence[int]],
                    outputs: Sequence[Sequence[int]], repetition: Sequence[float],
                    frequency: Sequence[float], presence: Sequence[float]) -> None:
    """vLLM's penalties (module docstring) on `rows` of `logits`, in place; `prompts`,
    `outputs` and the penalties are per entry of `rows`."""
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    sub = logits[rows]
    out_counts = _counts(outputs, vocab, device)
    out_mask = out_counts > 0
    rep = torch.tensor(repetition, dtype=sub.dtype, device=device).unsqueeze(1)
    if any(r != 1.0 for r in repetition):
        seen = out_mask | (_counts(prompts, vocab, device) > 0)
        scale = torch.where(seen, rep, torch.ones_like(sub))
        sub = torch.where(sub > 0, sub / scale, sub * scale)
    freq = torch.tensor(frequency, dtype=sub.dtype, device=device).unsqueeze(1)
    pres = torch.tensor(presence, dtype=sub.dtype, device=device).unsqueeze(1)
    sub = sub - freq * out_counts - pres * out_mask.to(sub.dtype)
    logits[rows] = sub


def gather_logprobs(raw: torch.Tensor, tokens: Sequence[int],
                    tops: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of `raw` logits: the log-softmax's value at the row's token and its `tops[i]`
    best (one top-k for the batch, one host read)."""
    lp = torch.log_softmax(raw.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1)
    k = max(tops, default=0)
    if k:
        top_vals, top_ids = lp.topk(min(k, lp.shape[1]), dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    chosen = chosen.tolist()
    return [TokenLogprobs(chosen[i], list(zip(top_ids[i][:n], top_vals[i][:n])) if n else [])
            for i, n in enumerate(tops)]
