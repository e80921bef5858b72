"""One request inside the engine, and what it streams back."""
from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from compute_service.engine.detokenize import TextStream
from compute_service.engine.logits_ops import TokenHistory, TokenLogprobs
from compute_service.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not matched (new, or preempted)
    RUNNING = "running"  # holds a lease, a Mamba slot and pages
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class Output:
    """What a request streams: new tokens and their text; `stats` set on the last message."""
    token_ids: list[int]
    text: str
    stats: RequestStats | None = None
    # One per token of `token_ids` when the request asked for logprobs (SamplingParams.logprobs).
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestStats:
    request_id: str
    worker: str
    prompt_tokens: int
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    cached_tokens_remote: int = 0
    shared_tokens_in_flight: int = 0
    # Its first token was sampled from a twin's logits (same prompt, in flight): Scheduler.twins.
    first_token_from_twin: bool = False
    computed_prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    # The phases vLLM's histograms name (vllm:request_queue_time_seconds, ..._prefill_..,
    # ..._decode_..): arrival -> first scheduled, -> first token, -> last token. A twin whose first
    # token came from a sibling's logits while it waited was never scheduled before it: its wait
    # is all queue, its prefill 0.
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # The gap before each output token after the first (inter-token latency; len = output - 1).
    token_gaps_s: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    preemptions: int = 0


@dataclass(slots=True, eq=False)
class Request:
    """Invariants while RUNNING: `pages` cover at least `computed` tokens of `tokens` (one page
    more after a lookahead allocation); the first `published` pages are in the cache service's
    tree, and `lease_tokens` >= `published` * page_size; the Mamba slot `slot` holds the state at
    `computed` when `has_state`."""
    id: str
    prompt: list[int]
    sampling: SamplingParams
    sink: Callable[[Output], None]
    adapter: str = ""
    salt: str = ""
    arrival: float = field(default_factory=time.monotonic)
    # Submission order (ties of `arrival` broken): the older request keeps its pages
    # (Scheduler.make_room).
    seq: int = field(default_factory=itertools.count().__next__)
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    lease: str | None = None
    # Tokens of `tokens` the lease has been told about: its match's, then those of the pages
    # it published (compute_service.engine.step_planner: a publish carries no more).
    lease_tokens: int = 0
    renewed_at: float = 0.0  # time.monotonic() of the last call that named the lease
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    published: int = 0
    slot: int = -1
    lora_slot: int = -1  # adapter registry slot while running, -1 = base model
    has_state: bool = False
    aborted: bool = False
    finish: FinishReason | None = None
    waited_on_sibling: bool = False
    # Its allocation for this step's forward failed and a younger request was preempted to free
    # pages: it sits out the forward, and nothing is admitted until it gets its pages.
    short_of_pages: bool = False
    resumed: bool = False  # matched before: do not count its hits again
    # page index -> per-Mamba-layer (ssm, conv) states to store as a checkpoint, or None for
    # "the running slot" (a decode step ended on that page).
    checkpoints: dict[int, list[tuple[torch.Tensor, torch.Tensor]] | None] = field(default_factory=dict)
    generator: torch.Generator | None = None
    # Its structured-output constraint's xgrammar matcher (compute_service/engine/grammar.py),
    # made at submission; None without a constraint.
    matcher: object | None = None
    # prompt_cache_retention's seconds (MatchOp.retain_s): the cache service protects its path.
    retain_s: float = 0.0
    text: TextStream = field(default_factory=TextStream)  # what of the output has streamed
    scheduled_at: float | None = None  # time.monotonic() it first left `waiting` to run
    first_token_at: float | None = None
    last_token_at: float | None = None
    stats: RequestStats | None = None
    # Its worker.Generate span's context (service_shell.tracing), or None: the engine's spans
    # (engine/step_traces.py) join the caller's trace through it.
    trace: object | None = None
    _packed: bytes = field(default=b"", repr=False)  # token_bytes() so far
    _history: TokenHistory | None = field(default=None, repr=False)  # token_history()

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)

    def token_history(self) -> TokenHistory:
        """Its tokens as the penalties read them (logits_ops.TokenHistory), up to date."""
        if self._history is None:
            self._history = TokenHistory(self.prompt)
        return self._history.update(self.output)

    def token_bytes(self) -> bytes:
        """The tokens as little-endian u32 (the cache service's packed form and page keys).
        Kept between calls (every step compares waiting requests with their siblings) and
        extended as tokens are appended: they are never changed in place."""
        if len(self._packed) != 4 * self.num_tokens:
            known = len(self._packed) // 4
            self._packed += np.asarray(self.tokens[known:], dtype="<u4").tobytes()
        return self._packed
