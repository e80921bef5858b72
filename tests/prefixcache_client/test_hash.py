"""Page-hash conformance (docs/design.md §3) against the vector file, and the hash command line."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from prefixcache.v1 import compute_service_pb2
from prefixcache_client.hash import namespace_seed, prompt_hashes, token_bytes

VECTORS = json.loads((pathlib.Path(__file__).parent.parent / "data" / "page_hash_vectors.json").read_text())
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", VECTORS["cases"],
                         ids=lambda c: f"{c['model_id']}|{c['adapter']}|{c['salt']}|P{c['page_size']}|{len(c['tokens'])}")
def test_vectors(case):
    assert namespace_seed(case["model_id"], case["adapter"], case["salt"]).hex() == case["namespace_seed"]
    got = prompt_hashes(case["tokens"], case["page_size"], case["model_id"], case["adapter"], case["salt"])
    assert [h.hex() for h in got] == case["page_hashes"]


def test_vectors_cover_the_spec_corners():
    cases = VECTORS["cases"]
    assert {c["page_size"] for c in cases} >= {1, 16, 64}
    assert any(c["model_id"] == "" and c["adapter"] == "" and c["salt"] == "" for c in cases)
    assert any(not c["model_id"].isascii() and not c["salt"].isascii() for c in cases)
    assert any(len(c["page_hashes"]) >= 3 for c in cases)
    assert any(c["tokens"] and len(c["tokens"]) < c["page_size"] and not c["page_hashes"] for c in cases)


def test_field_boundaries_are_unambiguous():
    # ("ab", "") and ("a", "b") must differ: the length prefix is what separates fields.
    assert namespace_seed("m", "ab", "") != namespace_seed("m", "a", "b")
    assert namespace_seed("m", "", "ab") != namespace_seed("m", "ab", "")


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7"])
@pytest.mark.parametrize("container", [list, tuple, iter])
def test_out_of_range_token_is_rejected_naming_the_field(bad, container):
    with pytest.raises(ValueError, match="token_ids"):
        token_bytes(container([1, bad]))


def test_every_kind_of_token_sequence_packs_to_the_same_bytes():
    # Lists and tuples take the array module's path, everything else numpy's: one layout.
    ids = [0, 1, 255, 256, 65535, 65536, 128255, 2**32 - 1]
    want = b"".join(i.to_bytes(4, "little") for i in ids)
    for tokens in (ids, tuple(ids), iter(ids), np.asarray(ids, dtype=np.uint32),
                   compute_service_pb2.TokenIds(ids=ids).ids):
        assert token_bytes(tokens) == want
    assert token_bytes([]) == token_bytes(()) == b""


def test_command_line_prints_one_hex_hash_per_full_page():
    case = next(c for c in VECTORS["cases"] if len(c["page_hashes"]) >= 3)
    out = subprocess.run(
        [sys.executable, "-m", "prefixcache_client.hash", "--model", case["model_id"], "--adapter",
         case["adapter"], "--salt", case["salt"], "--page-size", str(case["page_size"]),
         *map(str, case["tokens"])], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert out.splitlines() == case["page_hashes"]


def test_command_line_rejects_bad_token():
    res = subprocess.run(
        [sys.executable, "-m", "prefixcache_client.hash", "--model", "m", "--", "-5"],
        cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "token_ids" in res.stderr
