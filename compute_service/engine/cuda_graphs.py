"""CUDA graphs of DECODE forwards: the engine's per-step host overhead on a GPU.

A decode step of an 8B model is ~1,300 kernel launches (32 layers x norms, projections, RoPE,
the K/V write, two attention kernels, the MLP); launched one by one from Python they take
~20 ms of host time per step whatever the batch, against ~5 ms of HBM time for the weights.
A graph replays them all in one launch.

One graph per decode batch size B (exact, no padding: padding rows would write K/V somewhere),
captured the second consecutive step that decodes B sequences, over static input buffers:
ids, positions, cu_seqlens, prefix_lens, block tables (full width: ceil(max_context / page)),
slot mapping. The step that captures runs the real forward eagerly first (its K/V writes are
the step's own; the capture executes nothing), then replays the graph once on the same inputs
(the same K/V values written again) and compares the logits with the eager ones: any mismatch,
or any error while capturing, turns graphs off for this runner and the eager logits are used.

Used only on CUDA, for models without Mamba layers and batches without LoRA; off with
PREFIXCACHE_CUDA_GRAPHS=0.
"""
from __future__ import annotations

import logging
import os

import torch

from compute_service.model import ForwardBatch, ForwardMode

log = logging.getLogger(__name__)

MAX_GRAPHS = 24  # distinct batch sizes captured (each holds its own activations)
MAX_BATCH = 512


class _Graph:
    __slots__ = ("graph", "ids", "pos", "cu", "prefix", "tables", "slots", "state", "has",
                 "logits")

    def __init__(self) -> None:
        self.graph = self.logits = None


class DecodeGraphs:
    def __init__(self, model, kv, page_size: int, max_context: int, max_running: int):
        self.model, self.kv = model, kv
        self.width = -(-max_context // page_size)
        self.enabled = os.environ.get("PREFIXCACHE_CUDA_GRAPHS", "1") != "0"
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        self.last_batch = 0
        self.max_batch = min(MAX_BATCH, max_running)
        self.captures = 0
        self.replays = 0

    @classmethod
    def maybe(cls, model, kv, cfg, mamba: bool) -> DecodeGraphs | None:
        if model.device.type != "cuda" or mamba:
            return None
        return cls(model, kv, cfg.page_size, cfg.max_context, cfg.max_running)

    def wants(self, b: int, width: int) -> bool:
        """Whether a DECODE call of b sequences (block tables `width` pages wide, no LoRA)
        goes through a graph."""
        seen = self.last_batch == b
        self.last_batch = b
        return (self.enabled and b <= self.max_batch and width <= self.width
                and (b in self.graphs or (seen and len(self.graphs) < MAX_GRAPHS)))

    def run(self, ids: list[int], positions: list[int], slots: list[int], prefix: list[int],
            tables: list[list[int]]) -> torch.Tensor | None:
        """The DECODE logits [B, vocab] through this batch size's graph (captured now if it has
        none: that step runs eagerly too); None when graphs are off (the caller runs eagerly)."""
        b = len(ids)
        g = self.graphs.get(b)
        if g is not None:
            self._fill(g, ids, positions, slots, prefix, tables)
            self._replay(g)
            self.replays += 1
            return g.logits
        try:
            return self._capture(b, ids, positions, slots, prefix, tables)
        except Exception:  # noqa: BLE001 - graphs are an optimisation: eager from now on
            log.warning("CUDA graph capture failed: decode runs eagerly", exc_info=True)
            self.enabled = False
            return None

    def _fill(self, g: _Graph, ids, positions, slots, prefix, tables) -> None:
        b = len(ids)
        width = max(len(t) for t in tables)
        host = torch.tensor(ids + positions + slots, dtype=torch.int64)
        g.ids.copy_(host[:b], non_blocking=True)
        g.pos.copy_(host[b:2 * b], non_blocking=True)
        g.slots.copy_(host[2 * b:], non_blocking=True)
        g.prefix.copy_(torch.tensor(prefix, dtype=torch.int32), non_blocking=True)
        # Columns past a sequence's pages are never read (the kernel stops at seq_len).
        g.tables[:, :width].copy_(
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            non_blocking=True)

    def _batch(self, g: _Graph) -> ForwardBatch:
        return ForwardBatch(mode=ForwardMode.DECODE, cu_seqlens_q=g.cu, prefix_lens=g.prefix,
                            block_tables=g.tables, slot_mapping=g.slots, kv_caches=self.kv,
                            mamba_states=[], state_indices=g.state, has_initial_state=g.has)

    def _capture(self, b, ids, positions, slots, prefix, tables) -> torch.Tensor | None:
        device = self.model.device
        g = _Graph()
        g.ids = torch.zeros(b, dtype=torch.int64, device=device)
        g.pos = torch.zeros(b, dtype=torch.int64, device=device)
        g.slots = torch.zeros(b, dtype=torch.int64, device=device)
        g.prefix = torch.zeros(b, dtype=torch.int32, device=device)
        g.cu = torch.arange(b + 1, dtype=torch.int32, device=device)
        g.tables = torch.zeros(b, self.width, dtype=torch.int32, device=device)
        g.state = torch.zeros(b, dtype=torch.int32, device=device)  # no Mamba layers: unused
        g.has = torch.ones(b, dtype=torch.bool, device=device)
        self._fill(g, ids, positions, slots, prefix, tables)
        static = self._batch(g)

        def forward() -> torch.Tensor:
            return self.model(g.ids, g.pos, static).logits

        # The step's real forward (also the warm-up: Triton compiles, cuBLAS picks), then the
        # capture (executes nothing), then one replay on the same inputs to compare.
        eager = self._eager(forward)
        g.graph, g.logits = self._record(forward)
        self._replay(g)
        err = ((g.logits - eager).norm() / eager.norm().clamp_min(1e-30)).item()
        self.captures += 1
        if not err < 1e-3:
            log.warning("CUDA graph of decode batch %d differs from eager (rel err %.3g): "
                        "decode runs eagerly", b, err)
            self.enabled = False
            return eager
        self.graphs[b] = g
        return eager

    # ---- the CUDA calls (tests replace them with an eager emulation on CPU) -----------------

    def _eager(self, forward) -> torch.Tensor:
        """forward() on a side stream (as torch.cuda.graph wants its warm-up), as a copy."""
        device = self.model.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            out = forward().clone()
        torch.cuda.current_stream(device).wait_stream(stream)
        return out

    def _record(self, forward):
        """(graph, its static output) of forward()."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the cache caller or tier threads may touch CUDA during the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()
        return graph, out

    def _replay(self, g: _Graph) -> None:
        g.graph.replay()
