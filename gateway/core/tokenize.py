"""The gateway's tokenizer: the workers' own, so that the page hashes it routes on are the pages
the worker computes.

The gateway tokenizes text and chat prompts itself and forwards token ids. It uses the very
tokenizer code of the workers (`prefixcache_client.tokenizer`, torch-free) and, by default
(`--tokenizer auto`), the very files: the first worker identified with a tokenizer is asked for
it (GetTokenizer), the files are rebuilt into a tokenizer, and its recomputed fingerprint must
equal the one the worker reports, so no shared volume is needed and version skew is caught.
`--tokenizer byte` or `--tokenizer PATH` (a checkpoint directory) fixes it instead.

Invariants:
- A text or chat prompt is only routed to workers whose `tokenizer_fingerprint` equals the
  gateway's (`RouteRequest.tokenizer_fingerprint`, filtered by the router); token-id prompts go
  to any worker. A worker that differs is admitted (it serves token ids), logged with both
  fingerprints, and counted (`prefixcache_gateway_tokenizer_mismatched_workers`).
- Text and chats are refused with `TokenizerUnavailable`, naming the fingerprints, when no
  admitted worker shares the gateway's tokenizer (FAILED_PRECONDITION), or while the gateway
  knows no tokenizer yet (UNAVAILABLE: a worker that has one has not answered GetTokenizer),
  and counted (`prefixcache_gateway_tokenizer_refusals_total{reason}`).
- Once known, the gateway's tokenizer never changes: like the fleet's model id, it is fixed by
  the first worker, and later workers are measured against it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from gateway.core.metrics import GatewayMetrics
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.compute import ComputeClient, ComputeClientError
from prefixcache_client.tokenizer import (ByteTokenizer, Tokenizer, TokenizerError,
                                          from_directory, from_files)
from service_shell import kv

log = logging.getLogger("gateway.tokenize")

AUTO = "auto"
BYTE = "byte"


class TokenizerUnavailable(TokenizerError):
    """A text or chat prompt the gateway cannot tokenize for any worker; `code` is the gRPC
    status to answer with (a ValueError, as every TokenizerError)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _short(fingerprint: str) -> str:
    return fingerprint[:16] if fingerprint else "none"


class GatewayTokenizer:
    """The gateway's current tokenizer and the admitted workers' fingerprints (thread-safe)."""

    def __init__(self, spec: str = AUTO, metrics: GatewayMetrics | None = None) -> None:
        self.spec = spec
        self._metrics = metrics
        self._lock = threading.Lock()
        self._workers: dict[str, str] = {}  # admitted worker -> its tokenizer fingerprint
        self._current: Tokenizer | None = None
        if spec == BYTE:
            self._current = ByteTokenizer()
        elif spec != AUTO:
            self._current = from_directory(spec)  # FileNotFoundError / TokenizerError
        self._set_gauge()

    # ----- what the rest of the gateway asks --------------------------------------------------

    def current(self) -> Tokenizer | None:
        """The tokenizer text and chats are tokenized with; None until it is known."""
        return self._current

    @property
    def fingerprint(self) -> str:
        tok = self._current
        return tok.fingerprint if tok is not None else ""

    @property
    def has_chat_template(self) -> bool:
        tok = self._current
        return tok is not None and tok.chat_template is not None

    def text_ids(self, text: str) -> list[int]:
        """A text prompt's ids, with the workers' BOS rule (TokenizerUnavailable, see above)."""
        return self._require("prompt.text").text_prompt_ids(text)

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """A chat's prompt ids: the workers' chat template rendered in the sandbox and encoded
        as transformers' apply_chat_template(tokenize=True) does. TokenizerUnavailable, or
        NoChatTemplate / ChatTemplateError (ValueErrors naming the problem)."""
        return self._require("messages").chat_ids(messages, add_generation_prompt, tools)

    chat_ids = chat_prompt_ids

    def tokenizer_response(self) -> pb.GetTokenizerResponse:
        """GetTokenizer at the gateway: the same answer as a worker's."""
        tok = self._current
        if tok is None:
            raise TokenizerUnavailable(grpc.StatusCode.FAILED_PRECONDITION,
                                       "the gateway knows no tokenizer (yet): no worker with a "
                                       "tokenizer has been identified")
        return pb.GetTokenizerResponse(fingerprint=tok.fingerprint, files=[
            pb.TokenizerFile(name=n, content=tok.files[n]) for n in sorted(tok.files)])

    def fill_model_info(self, info: pb.GetModelInfoResponse) -> None:
        """GetModelInfo at the gateway describes the gateway's tokenizer."""
        tok = self._current
        info.tokenizer_fingerprint = self.fingerprint
        info.has_chat_template = self.has_chat_template
        info.ClearField("bos_token_id")
        if tok is not None and tok.adds_bos and tok.bos_token_id is not None:
            info.bos_token_id = tok.bos_token_id

    # ----- workers (gateway.core.workers) ------------------------------------------------------

    def worker_joined(self, name: str, info: pb.GetModelInfoResponse,
                      client: ComputeClient) -> None:
        """An admitted worker: learn its tokenizer if the gateway has none, then compare."""
        with self._lock:
            self._workers[name] = info.tokenizer_fingerprint
        self.learn(name, info, client)
        mine = self.fingerprint
        if mine and info.tokenizer_fingerprint != mine:
            self._log_mismatch(name, info.tokenizer_fingerprint, mine)
        self._set_gauge()

    def worker_left(self, name: str) -> None:
        with self._lock:
            self._workers.pop(name, None)
        self._set_gauge()

    def learn(self, name: str, info: pb.GetModelInfoResponse, client: ComputeClient) -> None:
        """With `--tokenizer auto` and none known yet: this worker's tokenizer, if it has one
        whose files hash to the fingerprint it reports. A failure is logged and left for the
        next worker, or for this one's next probe."""
        claimed = info.tokenizer_fingerprint
        if self.spec != AUTO or self._current is not None or not claimed:
            return
        try:
            resp = client.get_tokenizer()
            tok = from_files({f.name: f.content for f in resp.files})
        except (ComputeClientError, TokenizerError) as exc:
            log.warning(kv("tokenizer_fetch_failed", worker=name, error=exc))
            return
        if not tok.fingerprint == resp.fingerprint == claimed:
            log.warning(kv("tokenizer_fetch_failed", worker=name, reported=_short(claimed),
                           sent=_short(resp.fingerprint), recomputed=_short(tok.fingerprint),
                           error="the files do not hash to the fingerprint the worker reports "
                                 "(another prefixcache version?)"))
            return
        with self._lock:
            if self._current is not None:
                return
            self._current = tok
            others = {n: fp for n, fp in self._workers.items() if fp != tok.fingerprint}
        log.info(kv("tokenizer_learned", worker=name, fingerprint=tok.fingerprint,
                    kind=type(tok).__name__, vocab_size=tok.vocab_size,
                    chat_template=tok.chat_template is not None))
        for other, fp in sorted(others.items()):
            self._log_mismatch(other, fp, tok.fingerprint)
        self._set_gauge()

    # ----- internals ---------------------------------------------------------------------------

    def _require(self, field: str) -> Tokenizer:
        with self._lock:
            tok, workers = self._current, dict(self._workers)
        if tok is None:
            if any(workers.values()):
                self._refuse("unknown", grpc.StatusCode.UNAVAILABLE,
                             f"{field}: the gateway has not received the workers' tokenizer "
                             "yet; retry shortly, or send token_ids")
            self._refuse("no_tokenizer", grpc.StatusCode.FAILED_PRECONDITION,
                         f"{field}: no worker has a tokenizer (their checkpoints have no "
                         "tokenizer.json); send token_ids")
        if workers and tok.fingerprint not in workers.values():
            seen = ", ".join(f"{n}={_short(fp)}" for n, fp in sorted(workers.items()))
            self._refuse("no_compatible_worker", grpc.StatusCode.FAILED_PRECONDITION,
                         f"{field}: no worker tokenizes as this gateway does (gateway tokenizer "
                         f"{_short(tok.fingerprint)}, workers {seen}); send token_ids")
        return tok

    def _refuse(self, reason: str, code: grpc.StatusCode, message: str) -> None:
        if self._metrics is not None:
            self._metrics.tokenizer_refusals.labels(reason).inc()
        raise TokenizerUnavailable(code, message)

    def _log_mismatch(self, worker: str, theirs: str, mine: str) -> None:
        log.warning(kv("worker_tokenizer_mismatch", worker=worker, worker_tokenizer=theirs or
                       "none", gateway_tokenizer=mine,
                       effect="token-id prompts only: text and chats are not routed to it"))

    def _set_gauge(self) -> None:
        if self._metrics is None:
            return
        with self._lock:
            mine = self._current.fingerprint if self._current is not None else None
            n = sum(fp != mine for fp in self._workers.values()) if mine else 0
        self._metrics.tokenizer_mismatched_workers.set(n)


# The name gateway.core.proxy types its tokenizer with.
PromptTokenizer = GatewayTokenizer


def load_tokenizer(spec: str, metrics: GatewayMetrics | None = None) -> GatewayTokenizer:
    """`auto` (the workers' own), `byte`, or a checkpoint directory (see the module docstring)."""
    return GatewayTokenizer(spec, metrics)


def prompt_ids(request: pb.GenerateRequest, tokenizer: GatewayTokenizer) -> list[int]:
    """The token ids the worker would compute for `request`'s prompt. ValueError naming the
    field when there is none (the worker's own message for it); TokenizerUnavailable (also a
    ValueError, with its status code) for text the gateway cannot tokenize for any worker."""
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        ids = list(request.token_ids.ids)
    elif which == "text" and request.text:
        ids = tokenizer.text_ids(request.text)
    else:
        ids = []
    if not ids:
        raise ValueError("prompt: must not be empty")
    return ids


def prompt_fingerprint(request: pb.GenerateRequest, tokenizer: GatewayTokenizer) -> str:
    """The tokenizer a worker must have to be sent `request`: the gateway's for a text prompt,
    "" (any worker) for token ids."""
    return tokenizer.fingerprint if request.WhichOneof("prompt") == "text" else ""
