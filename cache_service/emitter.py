"""The event emitter of one pool: every page a call adds to or takes from a medium, as compact
records (`events` module docstring), in order.

A run of pages is one record, and a record continues the previous one when it extends its hash
chain on the same medium (stored) or leaves the same medium (removed), so one publish or one
eviction sweep is a handful of records however many pages it moves. Records hold the runs' own
bytes objects (a list of chunks, never a copy), and nothing here builds a protobuf message:
`events.EventLog` encodes a batch once, when it is first read.
"""
from __future__ import annotations

from cache_service.events import CHECKPOINT_DROPPED, CHECKPOINTED, CLEARED, REMOVED, STORED


class Emitter:
    __slots__ = ("pending",)

    def __init__(self):
        # seq 0 of every epoch: subscribers start from empty.
        self.pending: list[list] = [[CLEARED]]

    def stored(self, medium: int, parent: bytes, hashes: bytes, tokens: bytes,
               adapter: str, namespace: bytes = b"") -> None:
        """Pages entering `medium`; `parent` is the hash their chain continues (b"" at a
        namespace root); `namespace` is the namespace's seed (its root's hash), which only the
        vLLM-format publisher reads (a keyed hash of it names the namespace on that wire)."""
        pending = self.pending
        if pending and parent:
            last = pending[-1]
            if last[0] == STORED and last[1] == medium and last[3][-1][-16:] == parent:
                last[3].append(hashes)
                last[4].append(tokens)
                return
        pending.append([STORED, medium, parent, [hashes], [tokens], adapter, namespace])

    def checkpointed(self, page_hash: bytes, parent: bytes, tokens: bytes, adapter: str,
                     namespace: bytes) -> None:
        """A Mamba checkpoint now holds the state after page `page_hash` (hybrid pools). The
        gRPC stream does not carry it; the vLLM-format stream does (its Mamba group)."""
        self.pending.append([CHECKPOINTED, page_hash, parent, tokens, adapter, namespace])

    def checkpoint_dropped(self, page_hash: bytes) -> None:
        self.pending.append([CHECKPOINT_DROPPED, page_hash])

    def removed(self, medium: int, hashes: bytes) -> None:
        pending = self.pending
        if pending:
            last = pending[-1]
            if last[0] == REMOVED and last[1] == medium:
                last[2].append(hashes)
                return
        pending.append([REMOVED, medium, [hashes]])

    def cleared(self) -> None:
        self.pending.append([CLEARED])

    def take(self) -> list[list]:
        """The records since the last call, in order."""
        out, self.pending = self.pending, []
        return out
