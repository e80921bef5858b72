"""A workload that makes every kind of KV event, for the vLLM-format tests
(tests/cache_service/test_vllm_events_*.py): runs continuing their parent, several namespaces
(adapters and salts), eviction to host and off host, load-back, Mamba checkpoints appearing and
going, a namespace eviction, a new epoch; through a core or a CacheClient (the same calls)."""
from __future__ import annotations

import random

from prefixcache.v1 import cache_service_pb2 as pb, common_pb2

P = 4
MODEL = "m"
# Salts that must never appear in a published byte (test_vllm_events_tenants.py).
SALTS = ("tenant-secret-7f3a9c", "tenant-secret-b21e04")
NAMESPACES = [("", ""), ("lora-a", ""), ("", SALTS[0]), ("lora-a", SALTS[1])]


def register(pool: str, epoch: int = 1, device: int = 24, host: int = 16,
             slots: int = 4) -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(pool_id=pool, epoch=epoch, page_size=P, device_pages=device,
                                  host_pages=host, mamba_slots=slots, model_id=MODEL)


class Driver:
    """Drives one pool the way an engine does; `step` is a core's or a client's."""

    def __init__(self, step, pool: str, epoch: int = 1):
        self._step, self.pool, self.epoch = step, pool, epoch

    def step(self, **ops) -> pb.StepResponse:
        return self._step(pb.StepRequest(pool_id=self.pool, epoch=self.epoch, **ops))

    def run(self, tokens: list[int], adapter: str = "", salt: str = "",
            checkpoint: bool = False) -> None:
        ns = common_pb2.Namespace(adapter=adapter, salt=salt)
        m = self.step(matches=[pb.MatchOp(request_id="r", namespace=ns,
                                          token_ids=tokens)]).matches[0]
        need = -(-len(tokens) // P) - len(m.device_pages)
        if need and not self.step(allocations=[pb.AllocateOp(
                lease_id=m.lease_id, num_pages=need)]).allocations[0].ok:
            self.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])
            return
        full = len(tokens) // P
        self.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=full)])
        if checkpoint and full:
            self.step(checkpoints=[pb.CheckpointOp(lease_id=m.lease_id, page_index=full - 1)])
        self.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])


def run_workload(step, evict, register_pool, pool: str = "hyb", rounds: int = 3,
                 seed: int = 7, new_epoch: bool = True) -> None:
    """Everything the module docstring lists, on pool `pool` (registered here, epoch 1 then,
    with `new_epoch`, 2). `evict(request)` is EvictNamespace; `register_pool(request)` is
    RegisterPool."""
    rng = random.Random(seed)
    register_pool(register(pool))
    d = Driver(step, pool)
    base = [rng.randrange(1000) for _ in range(3 * P)]
    for adapter, salt in NAMESPACES:
        d.run(base + [1], adapter, salt, checkpoint=True)
        d.run(base + [rng.randrange(1000) for _ in range(2 * P + 1)], adapter, salt,
              checkpoint=True)  # continues the first run: parent is its last page
    for r in range(rounds):
        for i in range(6):  # more pages than the device holds: demotion, then host eviction
            adapter, salt = NAMESPACES[(r + i) % len(NAMESPACES)]
            d.run([r, i] + [rng.randrange(1000) for _ in range(4 * P)], adapter, salt,
                  checkpoint=i % 2 == 0)
        d.run(base + [1], *NAMESPACES[0], checkpoint=True)  # loads the demoted pages back
    evict(pb.EvictNamespaceRequest(pool_id=pool, namespace=common_pb2.Namespace(
        model_id=MODEL, adapter=NAMESPACES[2][0], salt=NAMESPACES[2][1])))
    if not new_epoch:
        return
    register_pool(register(pool, epoch=2))  # a new epoch: AllBlocksCleared, seq from 0 again
    d.epoch = 2
    for adapter, salt in NAMESPACES:
        d.run(base + [2, 3, 4, 5, 6], adapter, salt, checkpoint=True)
