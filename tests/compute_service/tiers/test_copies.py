"""Batched copies do exactly what the cache service's ordered copy list says, page by page."""
from __future__ import annotations

import random

import torch

from compute_service.tiers import PageLayout, plan_runs
from compute_service.tiers.copies import DEVICE, HOST, REMOTE
from compute_service.tiers.mover import TierMover
from prefixcache.v1 import common_pb2

LAYOUT = PageLayout(page_size=2, kv_dtype=torch.float32, kv_heads=1, head_dim=3,
                    attention_layers=2, mamba_layers=1, mamba_heads=1, mamba_head_dim=2,
                    mamba_state=2, conv_dim=2, conv_width=3, ssm_dtype=torch.float32,
                    conv_dtype=torch.float32)


def pools(device_pages: int, host_pages: int):
    def pool(n: int, offset: float):
        return [(torch.arange(n * 6, dtype=torch.float32).view(n, 2, 1, 3) + offset + 1000 * layer,
                 -torch.arange(n * 6, dtype=torch.float32).view(n, 2, 1, 3) - offset)
                for layer in range(2)]
    return pool(device_pages, 0.0), pool(host_pages, 0.5)


def copy_op(src, src_page, dst, dst_page, page_hash=b"", slot=-1):
    return common_pb2.CopyOp(src_medium=src, src_page=src_page, dst_medium=dst, dst_page=dst_page,
                             page_hash=page_hash, mamba_slot=slot)


class FakeRemote:
    def __init__(self):
        self.writes = []

    def write(self, hashes, kv, mamba):
        for i, h in enumerate(hashes):
            self.writes.append((h, kv[:, :, i].clone(), mamba[i]))


def test_random_copy_lists_match_one_page_at_a_time():
    rng = random.Random(0)
    for trial in range(40):
        kv, host = pools(6, 5)
        ref_kv = [(k.clone(), v.clone()) for k, v in kv]
        ref_host = [(k.clone(), v.clone()) for k, v in host]
        copies = []
        for _ in range(rng.randrange(1, 14)):
            if rng.random() < 0.5:
                copies.append(copy_op(DEVICE, rng.randrange(6), HOST, rng.randrange(5)))
            else:
                copies.append(copy_op(HOST, rng.randrange(5), DEVICE, rng.randrange(6)))
        for c in copies:  # the sequential meaning of the list
            src = ref_kv if c.src_medium == DEVICE else ref_host
            dst = ref_kv if c.dst_medium == DEVICE else ref_host
            for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
                dk[c.dst_page] = sk[c.src_page]
                dv[c.dst_page] = sv[c.src_page]
        TierMover(kv, host, [], 0, LAYOUT, None).run_copies(copies)
        for got, want in zip(kv + host, ref_kv + ref_host, strict=True):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), trial


def test_runs_split_on_direction_and_on_a_repeated_destination():
    copies = [copy_op(DEVICE, 0, HOST, 1), copy_op(DEVICE, 1, HOST, 2), copy_op(DEVICE, 2, HOST, 1),
              copy_op(HOST, 1, DEVICE, 0), copy_op(DEVICE, 3, REMOTE, 0, b"a"),
              copy_op(DEVICE, 3, REMOTE, 0, b"b")]
    runs = plan_runs(copies)
    assert [(r.src, r.dst, r.src_pages) for r in runs] == [
        (DEVICE, HOST, [0, 1]), (DEVICE, HOST, [2]), (HOST, DEVICE, [1]), (DEVICE, REMOTE, [3, 3])]


def test_an_l3_write_reads_its_page_before_a_later_copy_reuses_it():
    kv, host = pools(4, 4)
    states = [(torch.arange(6 * 4, dtype=torch.float32).view(6, 1, 2, 2),
               torch.arange(6 * 6, dtype=torch.float32).view(6, 2, 3))]
    before = kv[0][0][2].clone()
    remote = FakeRemote()
    mover = TierMover(kv, host, states, 2, LAYOUT, remote)
    # Write page 2 with its checkpoint slot 3, then load a host page into device page 2, then
    # write host page 3 with its slot 1.
    mover.run_copies([copy_op(DEVICE, 2, REMOTE, 0, b"p2", slot=3), copy_op(HOST, 0, DEVICE, 2),
                      copy_op(HOST, 3, REMOTE, 0, b"h3", slot=1)])
    (h0, kv0, m0), (h1, kv1, m1) = remote.writes
    assert h0 == b"p2" and torch.equal(kv0[0, 0], before)
    assert torch.equal(kv[0][0][2], host[0][0][0])  # the load-back happened after the read
    assert torch.equal(m0[0][0], states[0][0][2 + 3]) and torch.equal(m0[0][1], states[0][1][5])
    assert h1 == b"h3" and torch.equal(kv1[1, 1], host[1][1][3])
    assert torch.equal(m1[0][0], states[0][0][3])
