"""The vllm-kv-events component: every worker's cache sidecar publishes its KV events in vLLM's
format on 5557 (PUB) and 5558 (replay), with the namespace-id key from a Secret, reachable only
by labelled consumers."""
from __future__ import annotations

import pytest

from cache_service.__main__ import parse_args
from tests.deploy.manifests import (NAMESPACE, VARIANTS, by_kind, container, generated, one,
                                    pod_labels, workloads)
from tests.deploy.netpol import Peer, Policies
from tests.deploy.test_k8s_network import CLIENT, KV_CONSUMER, PROMETHEUS

WITH = sorted(v for v, (_, comps) in VARIANTS.items() if "vllm-kv-events" in comps)
WITHOUT = sorted(v for v, (_, comps) in VARIANTS.items() if "vllm-kv-events" not in comps)
PORTS = (5557, 5558)


@pytest.mark.parametrize("variant", WITH)
def test_the_cache_sidecar_publishes_with_a_key_from_a_secret(renders, variant):
    docs = renders[variant]
    cache = container(docs, "compute", "cache")
    assert cache.env_value("PREFIXCACHE_KV_EVENTS_ZMQ_ENDPOINT") == "tcp://*:5557"
    assert cache.env_value("PREFIXCACHE_KV_EVENTS_ZMQ_REPLAY_ENDPOINT") == "tcp://*:5558"
    assert cache.env_value("PREFIXCACHE_KV_EVENTS_TOPIC") == "kv@$(POD_IP)@{model_id}"
    names = [e["name"] for e in cache.spec["env"]]
    assert names.index("POD_IP") < names.index("PREFIXCACHE_KV_EVENTS_TOPIC")  # $(POD_IP) expands
    assert {p["containerPort"] for p in cache.spec["ports"]} >= set(PORTS)
    key = cache.env_value("PREFIXCACHE_KV_EVENTS_NAMESPACE_KEY_FILE")
    directory, _, filename = key.rpartition("/")
    mount = cache.mounts()[directory]
    assert mount["readOnly"] is True
    secret = cache.volume(mount["name"])["secret"]["secretName"]
    assert secret.startswith("kv-events-namespace-key") and filename in generated(
        docs, "Secret", "kv-events-namespace-key")["data"]
    service = one(docs, "Service", "cache-headless")
    assert {p["port"] for p in service["spec"]["ports"]} >= set(PORTS)
    # The cache service accepts what the manifest sets (the values it would read from the env).
    env = {e["name"]: e["value"] for e in cache.spec["env"] if "value" in e}
    encoding = env["PREFIXCACHE_KV_EVENTS_ENCODING"]
    args = parse_args(["--kv-events-zmq-endpoint", env["PREFIXCACHE_KV_EVENTS_ZMQ_ENDPOINT"],
                       "--kv-events-encoding", encoding,
                       "--kv-events-topic", env["PREFIXCACHE_KV_EVENTS_TOPIC"]])
    assert args.kv_events.encoding == encoding


@pytest.mark.parametrize("variant", WITH)
def test_only_labelled_consumers_reach_the_event_ports(renders, variant):
    docs = renders[variant]
    policies = Policies(docs, NAMESPACE)
    pods = {w["metadata"]["name"]: Peer(w["metadata"]["name"], f"10.244.1.{i + 1}", NAMESPACE,
                                        pod_labels(w)) for i, w in enumerate(workloads(docs))}
    for port in PORTS:
        assert policies.allows(KV_CONSUMER, pods["compute"], port)
        for peer in (CLIENT, PROMETHEUS, pods["gateway"], pods["redis"]):
            assert not policies.allows(peer, pods["compute"], port), (peer.name, port)
    assert not policies.allows(KV_CONSUMER, pods["compute"], 50051)  # nothing else opens
    assert not policies.allows(KV_CONSUMER, pods["redis"], 6379)


@pytest.mark.parametrize("variant", WITHOUT)
def test_off_without_the_component(renders, variant):
    docs = renders[variant]
    if not any(w["metadata"]["name"] == "compute" for w in by_kind(docs, "Deployment")):
        return
    cache = container(docs, "compute", "cache")
    assert cache.env_value("PREFIXCACHE_KV_EVENTS_ZMQ_ENDPOINT") is None
    assert not {p["containerPort"] for p in cache.spec["ports"]} & set(PORTS)
