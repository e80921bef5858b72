"""The model runner: the device side of the engine. It owns the paged KV cache and the Mamba
state slots, assembles one forward over a step's scheduled requests, runs it, and samples.

State slots (`states`): the first `max_running` are the running slots (one per running request,
handed out by the scheduler); the `checkpoint_slots` after them belong to the cache service,
which names the slot each Mamba checkpoint goes to (`store_checkpoints`) or comes from.

One forward (`run`):
- Before: every scheduled request holds pages covering `computed + n` tokens (the step's
  allocations succeeded) and its running slot holds the state at `computed` when `has_state`.
- Each request computes its next `n` tokens (a prefill chunk, or the one token of a decode) in
  one packed call; DECODE mode only when every request decodes with a state to resume.
- After: `computed` has grown by `n`, K/V of those tokens are in their pages, the running slot
  holds the state at `computed`; the pages completed on the way have their Mamba checkpoint
  kept in `Request.checkpoints` (a tensor copy, or None for "the running slot's state"), which
  the step's own overlapped call (the page a decode token completes) or the next step attaches
  (prefix caching off: none are kept). A request whose KV caught up with its tokens sampled its
  next token, and so did the waiting twins of a request whose prompt completed (same logits row,
  their own sampling parameters and generator: see compute_service.engine.scheduler).
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from compute_service.engine.config import EngineConfig, EngineStats
from compute_service.engine.cuda_graphs import DecodeGraphs
from compute_service.engine.request import Request
from compute_service.engine.grammar import GrammarEngine
from compute_service.engine.logits_ops import TokenLogprobs, bad_word_bans
from compute_service.engine.sampling import sample_batch
from compute_service.lora import AdapterRegistry
from compute_service.model import (CausalLM, ForwardBatch, ForwardMode, allocate_kv_caches,
                                   allocate_mamba_states)
from compute_service.tiers import PageData
from prefixcache.v1 import cache_service_pb2 as pb

PARALLEL_COPIES = 8  # checkpoint copies in one step from which a helper thread takes half

# (logits row, request whose prompt completed there) -> (logits row, waiting twin): Scheduler.twins
TwinFinder = Callable[[list[tuple[int, Request]]], list[tuple[int, Request]]]


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: EngineConfig, adapters: AdapterRegistry | None,
                 stats: EngineStats, eos: tuple[int, ...], checkpoint_slots: int,
                 grammar: GrammarEngine | None = None):
        mc = model.config
        self.grammar = grammar  # structured output's masks (engine.grammar)
        self.model, self.cfg, self.adapters, self.stats, self.eos = model, cfg, adapters, stats, eos
        self.mamba = bool(mc.mamba_layer_ids)
        # Mamba checkpoints are kept only to be published: not without a prefix cache.
        self.checkpoints = self.mamba and cfg.prefix_cache
        self.kv = allocate_kv_caches(mc, cfg.device_pages, cfg.page_size, model.dtype, model.device)
        # Running slots first, then the cache service's checkpoint slots.
        self.states = (allocate_mamba_states(mc, cfg.max_running + checkpoint_slots, model.dtype,
                                             model.device) if self.mamba else [])
        self._copier: ThreadPoolExecutor | None = None  # store_checkpoints' helper, on CPU
        # CUDA graphs of decode steps (GPU, attention-only models): see engine.cuda_graphs.
        self.graphs = DecodeGraphs.maybe(model, self.kv, cfg, self.mamba)
        self.parallel_copies = PARALLEL_COPIES

    # ---- the forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: list[tuple[Request, int]], twins: TwinFinder
            ) -> list[tuple[Request, int, TokenLogprobs | None]]:
        """One forward over (request, tokens to compute); returns the (request, token, its
        logprobs if asked for) sampled, in order, for the scheduler to emit."""
        host = self._host_inputs(batch)
        ids, positions, slots, cu, prefix, decode = host
        lora = (self.adapters.lora_batch([r.lora_slot for r, _ in batch], [n for _, n in batch])
                if self.adapters is not None else None)
        width = max(len(r.pages) for r, _ in batch)
        logits = None
        if (self.graphs is not None and decode and lora is None
                and self.graphs.wants(len(batch), width)):
            logits = self.graphs.run(ids, positions, slots, prefix, [r.pages for r, _ in batch])
        if logits is None:
            device = self.model.device
            fb = self._device_batch(batch, host, lora)
            out = self.model(torch.tensor(ids, dtype=torch.int64, device=device),
                             torch.tensor(positions, dtype=torch.int64, device=device), fb)
            logits = out.logits
            if out.mamba_boundaries is not None:
                self._keep_boundaries(batch, out.mamba_boundaries)
        self.stats.forward_tokens += len(ids)
        ready = self._advance(batch)
        if not ready:
            return []
        rows, reqs = [i for i, _ in ready], [r for _, r in ready]
        for i, twin in twins([(i, r) for i, r in ready if not r.output]):
            rows.append(i)
            reqs.append(twin)
            twin.stats.first_token_from_twin = True
            self.stats.twin_first_tokens += 1
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[rows]
        banned = [self._banned(r) for r in reqs]
        params = [r.sampling for r in reqs]
        # Token histories only where penalties read them, kept on the request between steps.
        history = ([r.token_history() if r.sampling.penalized else None for r in reqs]
                   if any(p.penalized for p in params) else None)
        constrained = self.grammar is not None and any(r.sampling.constraint for r in reqs)
        mask = (lambda rows: self.grammar.mask(rows, reqs)) if constrained else None
        got = sample_batch(logits.float(), params, [r.generator for r in reqs], banned, history,
                           mask=mask)
        if self.grammar is not None:
            self.grammar.advance(reqs, got.tokens)
        return list(zip(reqs, got.tokens, got.logprobs, strict=True))

    def _host_inputs(self, batch: list[tuple[Request, int]]):
        """The packed token ids, their absolute positions, slot mapping (where each new token's
        K/V goes), cu_seqlens, prefix lengths (host lists), and whether the call is a DECODE."""
        P = self.cfg.page_size
        ids, positions, slots, cu, prefix = [], [], [], [0], []
        decode = True
        for r, n in batch:
            c = r.computed
            if n == 1:  # a decode: no copy of prompt + output (`r.tokens`) per step
                np_ = len(r.prompt)
                ids.append(r.prompt[c] if c < np_ else r.output[c - np_])
                positions.append(c)
                slots.append(r.pages[c // P] * P + c % P)
            else:
                ids += r.tokens[c:c + n]
                positions += range(c, c + n)
                slots += [r.pages[p // P] * P + p % P for p in range(c, c + n)]
            cu.append(cu[-1] + n)
            prefix.append(c)
            if decode and not (n == 1 and c > 0 and (r.has_state or not self.mamba)):
                decode = False
        return ids, positions, slots, cu, prefix, decode

    def _device_batch(self, batch, host, lora) -> ForwardBatch:
        """The ForwardBatch of `host` (see `_host_inputs`): block tables, prefix lengths, slot
        mapping, running slots on the model's device."""
        _, _, slots, cu, prefix, decode = host
        device = self.model.device
        width = max(len(r.pages) for r, _ in batch)
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        return ForwardBatch(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, cu_seqlens_q=i32(cu),
            prefix_lens=i32(prefix),
            block_tables=i32([r.pages + [0] * (width - len(r.pages)) for r, _ in batch]),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), kv_caches=self.kv,
            mamba_states=self.states, state_indices=i32([max(r.slot, 0) for r, _ in batch]),
            has_initial_state=torch.tensor([r.has_state for r, _ in batch], dtype=torch.bool,
                                           device=device),
            mamba_checkpoint_interval=self.cfg.page_size if self.checkpoints and not decode else 0,
            lora=lora, max_q_len=max(n for _, n in batch))

    def _advance(self, batch: list[tuple[Request, int]]) -> list[tuple[int, Request]]:
        """Moves `computed` past the tokens just computed; returns (logits row, request) for
        those whose KV caught up with their tokens (they sample)."""
        P = self.cfg.page_size
        ready = []
        for i, (r, n) in enumerate(batch):
            r.stats.computed_prompt_tokens += max(0, min(r.computed + n, len(r.prompt)) - r.computed)
            r.computed += n
            r.has_state = True
            # A call that ends on a page boundary (e.g. a decode) leaves that page's state in the
            # running slot: the checkpoint is copied from there once the page is published.
            if self.checkpoints and r.computed % P == 0:
                r.checkpoints[r.computed // P - 1] = None
            if r.computed == r.num_tokens:
                ready.append((i, r))
        return ready

    def _keep_boundaries(self, batch, bounds) -> None:
        """Keeps the Mamba states at the page boundaries inside this call that should become
        checkpoints: every `checkpoint_every_pages` pages and the prompt's last whole page
        (design.md lesson 8: positions are absolute, whichever chunk they fall in). The state at
        a chunk's end is the running slot's and is copied from there."""
        P, every = self.cfg.page_size, self.cfg.page_size * self.cfg.checkpoint_every_pages
        for k, (b, pos) in enumerate(zip(bounds.seq_index.tolist(), bounds.positions.tolist())):
            r, n = batch[b]
            if pos < r.computed + n and (pos % every == 0 or pos == len(r.prompt) // P * P):
                r.checkpoints[pos // P - 1] = [(s[k].clone(), c[k].clone())
                                               for s, c in zip(bounds.ssm, bounds.conv, strict=True)]

    def _banned(self, r: Request) -> tuple[int, ...]:
        """Tokens it may not sample now: its stop tokens (and EOS) until `min_tokens`, and the
        ones its bad_words ban after its output so far."""
        sp = r.sampling
        words = tuple(bad_word_bans(sp.bad_words, r.output)) if sp.bad_words else ()
        if len(r.output) >= sp.min_tokens:
            return words
        return tuple(sp.stop_token_ids) + (() if sp.ignore_eos else self.eos) + words

    # ---- Mamba state slots --------------------------------------------------------------------

    def copy_state(self, src: int, dst: int) -> None:
        for ssm, conv in self.states:
            ssm[dst].copy_(ssm[src])
            conv[dst].copy_(conv[src])

    def snapshot_state(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of a running slot's state, per Mamba layer (as `Request.checkpoints` keeps)."""
        return [(ssm[slot].clone(), conv[slot].clone()) for ssm, conv in self.states]

    def store_checkpoints(self, stored: list[tuple[Request, pb.CheckpointResult]]) -> None:
        """Writes the checkpoint of each r's page `res.page_index` into the cache service's slot
        `res.slot` (unless it refused it or has one already); the kept states are dropped.

        On CPU the copies are memory-bound (a state is megabytes): many of them, into distinct
        slots, are split with a helper thread (torch releases the GIL while it copies), so a
        decode that completes a page in every request does not stall for all of them on one
        core. Done before returning: the step's L3 writes read these slots next."""
        copies: list[tuple[int | list[tuple[torch.Tensor, torch.Tensor]], int]] = []
        for r, res in stored:
            states = r.checkpoints.pop(res.page_index, None)
            if res.ok and not res.already_present:
                # None: the running slot holds the state at this page's end.
                copies.append((r.slot if states is None else states,
                               self.cfg.max_running + res.slot))
        if (len(copies) >= self.parallel_copies and self.model.device.type == "cpu"
                and len({dst for _, dst in copies}) == len(copies)):
            if self._copier is None:
                self._copier = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-copy")
            half = len(copies) // 2
            other = self._copier.submit(self._copy, copies[half:])
            self._copy(copies[:half])
            other.result()
        else:
            self._copy(copies)

    def _copy(self, copies) -> None:
        for src, dst in copies:
            if isinstance(src, int):
                self.copy_state(src, dst)
                continue
            for (ssm, conv), (s, c) in zip(self.states, src, strict=True):
                ssm[dst].copy_(s)
                conv[dst].copy_(c)

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown(wait=False)
            self._copier = None

    def resume_from_remote(self, r: Request, first: int, remote: list[PageData]) -> None:
        """Puts the checkpoint of the last loaded page (TierMover guarantees it has one) into the
        running slot, and keeps the loaded checkpoints that this pool would have taken itself
        (every `checkpoint_every_pages`, and the deepest) to attach once the pages are
        published."""
        device = self.model.device
        for (ssm, conv), (s, c) in zip(self.states, remote[-1].mamba, strict=True):
            ssm[r.slot].copy_(s)
            conv[r.slot].copy_(c)
        r.has_state = True
        every = self.cfg.checkpoint_every_pages
        for i, page in enumerate(remote):
            index = first + i
            if page.mamba is not None and ((index + 1) % every == 0 or i == len(remote) - 1):
                r.checkpoints[index] = [(s.to(device), c.to(device)) for s, c in page.mamba]
