"""pagestore/page_format.py on bytes alone (no torch): a sealed body opens again only under the
same page hash, Redis key, format and MAC key. The tensor round trips and every rejection reason
are in tests/compute_service/tiers/test_payload.py and test_mac.py."""
from __future__ import annotations

import pytest

from pagestore.page_format import BODY_OFFSET, PageFormat, PayloadRejected, open_payload, seal

HASH = bytes(range(16))
FMT = PageFormat(fields=(2, 1, 4, 1, 0, 0, 0, 0, 0, 0), codes=(1, 0, 0), kv_bytes=64,
                 checkpoint_bytes=0)
BODY = [bytes(range(32)), bytes(range(32, 64))]
KEY = b"k" * 32


def test_a_sealed_body_opens_with_the_same_key_and_redis_key():
    payload = seal(HASH, FMT, BODY, checkpoint=False, mac_key=KEY, context=b"pc:m:00")
    assert len(payload) == BODY_OFFSET + 64
    has_ckpt, body = open_payload(payload, HASH, FMT, mac_key=KEY, context=b"pc:m:00")
    assert not has_ckpt and bytes(body) == b"".join(BODY)


@pytest.mark.parametrize("change, reason", [
    ({"context": b"pc:other:00"}, "bad_mac"),
    ({"mac_key": b"x" * 32}, "bad_mac"),
    ({"mac_key": None}, "unverifiable"),
    ({"expected_hash": bytes(16)}, "wrong_hash"),
    ({"fmt": PageFormat(FMT.fields, (2, 0, 0), 64, 0)}, "wrong_layout"),
])
def test_anything_else_is_rejected_with_its_reason(change, reason):
    payload = seal(HASH, FMT, BODY, checkpoint=False, mac_key=KEY, context=b"pc:m:00")
    args = {"expected_hash": HASH, "fmt": FMT, "mac_key": KEY, "context": b"pc:m:00", **change}
    with pytest.raises(PayloadRejected) as err:
        open_payload(payload, args.pop("expected_hash"), args.pop("fmt"), **args)
    assert err.value.reason == reason
