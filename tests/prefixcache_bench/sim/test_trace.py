from __future__ import annotations

import json

import pytest

from prefixcache_bench.sim.engine import split_hashes
from prefixcache_bench.sim.trace import (BlockTokens, CopyHashes, copy_page_hashes, load_trace, main, scale_copies,
                                        write_synthetic)
from prefixcache_client.hash import prompt_hashes, token_bytes


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_trace_scales_time_caps_outputs_and_validates(tmp_path):
    path = _write(tmp_path / "t.jsonl", [
        {"timestamp": 2000, "input_length": 600, "output_length": 9000, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 10, "output_length": 5, "hash_ids": [1]},
    ])
    reqs = load_trace(path, time_scale=2.0, max_output_tokens=100)
    assert [(r.arrival_s, r.output_length) for r in reqs] == [(0.5, 5), (1.0, 100)]
    assert len(load_trace(path, max_requests=1)) == 1
    bad = _write(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 2000, "output_length": 1,
                                           "hash_ids": [1]}])
    with pytest.raises(ValueError, match="input_length"):
        load_trace(bad)


def test_block_tokens_are_deterministic_in_vocab_and_hash_like_the_cache_service(tmp_path):
    path = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [7, 8]},
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [7, 9]},
    ])
    a, b = load_trace(path)
    blocks = BlockTokens(vocab_size=1000, seed=3)
    ta, tb = blocks.prompt_tokens(a), blocks.prompt_tokens(b)
    assert len(ta) == 700 and len(tb) == 1024
    assert ta[:512] == tb[:512] and ta[512:700] != tb[512:700]
    assert all(0 <= t < 1000 for t in ta + tb)
    assert BlockTokens(vocab_size=1000, seed=3).prompt_tokens(a) == ta
    assert BlockTokens(vocab_size=1000, seed=4).prompt_tokens(a) != ta
    assert blocks.block_bytes(7) == token_bytes(ta[:512])
    assert blocks.page_hashes(a, 16, "m", "ad", "s") == prompt_hashes(ta, 16, "m", "ad", "s")
    assert len(blocks.page_hashes(a, 16, "m")) == 700 // 16


@pytest.mark.parametrize("kind", ["chat", "rollout"])
def test_synthetic_traces_are_valid_mooncake_traces(tmp_path, kind):
    path = tmp_path / f"{kind}.jsonl"
    assert main(["--synth", kind, "--out", str(path), "--requests", "300", "--seed", "1"]) == 0
    reqs = load_trace(path)
    assert len(reqs) == 300
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    # Some requests share leading blocks with an earlier one: there is prefix reuse to find.
    seen, shared = set(), 0
    for r in reqs:
        shared += r.hash_ids[0] in seen
        seen.update(r.hash_ids)
    assert shared > 100
    again = tmp_path / "again.jsonl"
    write_synthetic(kind, again, 300, seed=1)
    assert again.read_text() == path.read_text()


def test_scaled_trace_keeps_each_copy_and_shares_nothing_across_copies(tmp_path):
    path = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 900, "output_length": 4, "hash_ids": [0, 2]},
        {"timestamp": 1500, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 3]},
    ])
    original = load_trace(path)
    scaled = scale_copies(original, copies=3, spacing_s=0.25)
    assert len(scaled) == 9 and [r.index for r in scaled] == list(range(9))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(scaled, scaled[1:]))
    for k in range(3):
        copy = [r for r in scaled if r.copy == k]
        # Same requests in the same order, `k x spacing` late, naming their original.
        assert [(r.arrival_s, r.input_length, r.output_length, r.hash_ids, r.source) for r in copy] == [
            (o.arrival_s + 0.25 * k, o.input_length, o.output_length, o.hash_ids, i)
            for i, o in enumerate(original)]
    # Copies share no page: copy k's hashes are the original's under copy k's mask (copy 0's
    # are the original's), and each copy keeps every page the original's requests share.
    blocks = BlockTokens(vocab_size=1000)
    blobs = [b"".join(blocks.page_hashes(o, 16, "m")) for o in original]
    hashes = CopyHashes(scaled, blobs)
    pages = [[split_hashes(hashes[i]) for i, r in enumerate(scaled) if r.copy == k] for k in range(3)]
    assert [b"".join(p) for p in pages[0]] == blobs
    sets = [{h for p in pages[k] for h in p} for k in range(3)]
    assert all(len(s) == len(sets[0]) > 0 for s in sets)
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    for k in range(3):  # the same pages in the same places: page j of request i is page j' of i'
        where = {h: (i, j) for i, p in enumerate(pages[k]) for j, h in enumerate(p)}
        assert where == {h: (i, j) for i, p in enumerate(pages[0]) for j, h in enumerate(p)
                         for h in [split_hashes(copy_page_hashes(h, k))[0]]}
    # The first N of the merged timeline; one copy is the trace itself.
    assert [(r.copy, r.source) for r in scale_copies(original, 3, 0.25, max_requests=4)] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(r.arrival_s, r.hash_ids) for r in scale_copies(original, 1)] == [
        (o.arrival_s, o.hash_ids) for o in original]
    with pytest.raises(ValueError):
        scale_copies(original, 0)
