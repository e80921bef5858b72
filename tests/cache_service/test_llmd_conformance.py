"""Our vLLM-format KV events as llm-d's indexer sees them (tests/cache_service/llmd_port.py, a
port of llm-d-kv-cache 7be76e1, checked here against llm-d's own golden vectors): the batches a
live cache service publishes decode, and the keys llm-d computes from them are the keys it
computes from each cached prompt, per namespace (plain, adapter, salted tenant), and no other
namespace's; a plain-text prompt scores the pool that computed it."""
from __future__ import annotations

import hashlib
import hmac
import json
import pathlib

import msgspec
import pytest
import zmq

from cache_service.core import CacheCore
from cache_service.events import STORED
from cache_service.tree import DEVICE, nodes_below
from cache_service.vllm_events import VllmEncoder
from cache_service.zmq_publisher import ZmqEventPublisher, ZmqEventsConfig
from prefixcache_client.hash import namespace_seed
from tests.cache_service.llmd_port import (Index, LlmdDecodeError, TokenProcessor,
                                           compute_block_extra_features, parse_message)
from tests.cache_service.test_vllm_events_conformance import wait_subscribed
from tests.cache_service.vllm_events_workload import (MODEL, NAMESPACES, P, Driver, register,
                                                      run_workload)

VECTORS = pathlib.Path(__file__).resolve().parents[1] / "data" / "llm_d_kv_cache_7be76e1_vectors.json"
KEY = b"llm-d-conformance-namespace-key!"


def namespace_id(adapter: str, salt: str) -> str:
    return hmac.new(KEY, namespace_seed(MODEL, adapter, salt), hashlib.sha256).digest()[:8].hex()


def prompt_keys(tokens: list[int], adapter: str, salt: str) -> list[int]:
    """The keys llm-d computes for a prompt of this namespace: the model is the adapter's name
    when there is one (as llm-d scores a LoRA request); a salted tenant's router passes the
    namespace id as block 0's extra key (docs/kv-events.md)."""
    blocks = len(tokens) // P
    extra = [[namespace_id(adapter, salt)]] + [None] * (blocks - 1) if salt and blocks else None
    return TokenProcessor(P).keys(0, tokens, adapter or MODEL, extra)


# ---- the port against llm-d's golden vectors ------------------------------------------------

def test_port_reproduces_llm_d_golden_keys():
    vectors = json.loads(VECTORS.read_text())
    text = vectors["text"]
    assert TokenProcessor(text["block_size"], text["hash_seed"]).keys(
        0, text["token_ids"], text["model"]) == text["request_keys"]
    mm = vectors["multimodal"]
    places = {k: [(p["offset"], p["length"]) for p in v] for k, v in mm["mm_placeholders"].items()}
    extra = compute_block_extra_features(mm["mm_hashes"], places, mm["block_size"],
                                         len(mm["token_ids"]))
    keys = TokenProcessor(mm["block_size"], mm["hash_seed"]).keys(0, mm["token_ids"],
                                                                  mm["model"], extra)
    assert keys == mm["request_keys"]
    # The port can fail: the same tokens without their image hash give other keys.
    assert TokenProcessor(4).keys(0, mm["token_ids"], mm["model"])[4:] != keys[4:]


def test_llm_d_decodes_the_array_encoding_only():
    """llm-d unmarshals each event into a list: our default (array) decodes, the map encoding
    (vLLM 0.33's own) is refused, which is why array is the default."""
    # [kind, medium, parent, hashes, tokens, adapter, namespace seed]: one plain root page.
    record = [[STORED, 1, b"", [b"\x01" * 16], [b"\x00" * 16], "", namespace_seed(MODEL)]]
    for encoding, ok in (("array", True), ("map", False)):
        payload = VllmEncoder(encoding, KEY).batch(1.0, record, 4, model_id=MODEL)
        if ok:
            assert parse_message(f"kv@w@{MODEL}", payload)[2][0]["type"] == "BlockStored"
        else:
            with pytest.raises(LlmdDecodeError):
                parse_message(f"kv@w@{MODEL}", payload)


# ---- live batches ---------------------------------------------------------------------------

def published(workload) -> tuple[list[tuple[str, bytes]], CacheCore]:
    """(topic, payload) of every batch a cache service publishes while `workload(core)` runs,
    and the core."""
    core = CacheCore()
    pub = ZmqEventPublisher(core, ZmqEventsConfig("tcp://127.0.0.1:*", namespace_key=KEY))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        wait_subscribed(pub, sub)
        workload(core)
        pub.start()
        out = []
        while sub.poll(500):
            topic, _seq, payload = sub.recv_multipart()
            out.append((topic.decode(), payload))
        return out, core
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.close()


def path_tokens(node) -> list[int]:
    parts = []
    while hasattr(node, "tokens"):
        parts.append(node.tokens)
        node = node.parent
    return list(memoryview(b"".join(reversed(parts))).cast("I"))


def test_every_cached_page_is_where_llm_d_computes_its_prompts_key():
    batches, core = published(lambda c: run_workload(c.step, c.evict_namespace, c.register_pool,
                                                     "w1", rounds=2, new_epoch=False))
    assert batches and all(t == f"kv@w1@{MODEL}" for t, _ in batches)
    index = Index(TokenProcessor(P))
    for topic, payload in batches:
        index.apply(topic, payload)
    pool = core._pools["w1"]  # the tree itself: the reference
    expected: dict[int, set] = {}
    per_namespace: dict[tuple[str, str], set[int]] = {}
    for (adapter, salt), root in pool.roots.items():
        for node in nodes_below(root):
            pages = len(node.hashes) // 16
            keys = prompt_keys(path_tokens(node), adapter, salt)[-pages:]
            medium = "gpu" if node.medium == DEVICE else "cpu"
            for k in keys:
                expected.setdefault(k, set()).add(("w1", medium, 0))
            per_namespace.setdefault((adapter, salt), set()).update(keys)
    assert len(per_namespace) == len(NAMESPACES) - 1  # one namespace was evicted
    held = {k: {e for e in v if e[2] == 0} for k, v in index.pods_of.items()}
    held = {k: v for k, v in held.items() if v}
    assert held == expected
    # No key of one namespace is another's: llm-d keeps tenants and adapters apart.
    seen: set[int] = set()
    for keys in per_namespace.values():
        assert not keys & seen
        seen |= keys


def test_a_plain_prompt_scores_the_worker_that_computed_it_and_only_in_its_namespace():
    prompt = list(range(100, 100 + 5 * P + 2))

    def workload(core):
        for pool, (adapter, salt) in (("w1", ("", "")), ("w2", ("", "tenant-b")),
                                      ("w3", ("lora-a", ""))):
            core.register_pool(register(pool))
            Driver(core.step, pool).run(prompt, adapter, salt)
        core.register_pool(register("w4"))  # the same prompt in two steps: a run's continuation
        d = Driver(core.step, "w4")
        d.run(prompt[:2 * P], "", "")
        d.run(prompt, "", "")

    batches, _ = published(workload)
    index = Index(TokenProcessor(P))
    for topic, payload in batches:
        index.apply(topic, payload)
    assert index.dropped_events == 0
    full = len(prompt) // P
    assert index.score(prompt_keys(prompt, "", "")) == {"w1": full, "w4": full}
    assert index.score(prompt_keys(prompt, "", "tenant-b")) == {"w2": full}
    assert index.score(prompt_keys(prompt, "lora-a", "")) == {"w3": full}
    assert index.score(prompt_keys(prompt, "", "tenant-c")) == {}
    # What llm-d's own scorer does for a text request today (no extra keys): the plain and the
    # adapter namespaces match; a salted tenant's pages are never offered to anyone else.
    plain = TokenProcessor(P).keys(0, prompt, MODEL)
    assert index.score(plain) == {"w1": full, "w4": full}


def test_salts_stay_off_the_wire_and_plain_pages_carry_no_extra_keys():
    batches, _ = published(lambda c: run_workload(c.step, c.evict_namespace, c.register_pool,
                                                  "w1", rounds=1))
    stored = [ev for _, payload in batches for ev in msgspec.msgpack.decode(payload)[1]
              if ev[0] == "BlockStored"]
    ids = {namespace_id(a, s): (a, s) for a, s in NAMESPACES}
    for ev in stored:
        parent, extra = ev[2], ev[8]
        if extra is None:
            continue
        assert parent is None, "only a run at the namespace root names its namespace"
        assert all(e is None for e in extra[1:]) and ids[extra[0][0]][1], extra
        # Dynamo takes only 64-hex-digit strings there (multimodal ids): ours are 16.
        assert len(extra[0][0]) == 16
    assert any(ev[8] is None and ev[2] is None for ev in stored)  # plain roots: no extra keys
