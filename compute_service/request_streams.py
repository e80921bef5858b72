"""Requests between the engine thread and their Generate handlers: each request's queue of
outputs, and the registry of running requests by id."""
from __future__ import annotations

import queue
import threading

from compute_service.engine import Output


class RequestStream:
    """One request between the engine thread (which puts its outputs) and its Generate handler
    (which takes them). The engine never blocks on a slow client: outputs queue up here and the
    handler sends everything queued as one message."""

    __slots__ = ("request_id", "client_id", "cancel_requested", "sent", "handed_back", "span",
                 "_outputs")

    def __init__(self, request_id: str, client_id: str | None = None):
        # `request_id`: the id it runs under here (the engine's, the registry's): the client's
        # within its tenant's scope (server_messages.scoped_request_id); `client_id`: the
        # client's own, the one its answer names.
        self.request_id = request_id
        self.client_id = request_id if client_id is None else client_id
        self.span = None  # its worker.Generate span (service_shell.tracing), None when off
        # Set when the client left or Abort named the request: from then on the engine is asked
        # to abort it again at every token, until it does (see ComputeServicer._sink).
        self.cancel_requested = False
        # The handler sent the client a message (from then on its answer can only be finished).
        self.sent = False
        # A drain aborted it before anything was sent: the call ends UNAVAILABLE, which the
        # gateway retries on another worker (ComputeServer.drain).
        self.handed_back = False
        self._outputs: queue.SimpleQueue[Output] = queue.SimpleQueue()

    def put(self, out: Output) -> None:
        self._outputs.put(out)

    def take(self, timeout_s: float) -> list[Output]:
        """The next outputs (through the final one at most); [] when none came in time."""
        try:
            outs = [self._outputs.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while outs[-1].stats is None:
            try:
                outs.append(self._outputs.get_nowait())
            except queue.Empty:
                break
        return outs


class RunningRequests:
    """Requests submitted and not finished, by id: ids are unique among them, and Abort and drain
    find them here."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._changed = threading.Condition()

    def add(self, stream: RequestStream) -> bool:
        """False (and nothing added) when a request by that id is running."""
        with self._changed:
            if stream.request_id in self._streams:
                return False
            self._streams[stream.request_id] = stream
            return True

    def remove(self, request_id: str) -> None:
        with self._changed:
            self._streams.pop(request_id, None)
            self._changed.notify_all()

    def get(self, request_id: str) -> RequestStream | None:
        with self._changed:
            return self._streams.get(request_id)

    def snapshot(self) -> list[RequestStream]:
        with self._changed:
            return list(self._streams.values())

    def unsent(self, skip: set[str] | frozenset[str] = frozenset()) -> list[RequestStream]:
        """The streams that sent their client nothing yet (a drain may hand them back), but
        those whose id is in `skip`."""
        with self._changed:
            return [s for s in self._streams.values() if not s.sent and s.request_id not in skip]

    def wait_empty(self, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._streams, timeout_s)

    def __len__(self) -> int:
        return len(self._streams)
