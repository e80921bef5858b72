"""Workers sized from memory and scaled on their own signals: the gpu overlay's KV budget flags,
the autoscaling-workers component (a KEDA ScaledObject on the compute Deployment, triggers on
metrics the workers really export), and a termination grace that covers the whole drain."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from compute_service.sizing import SizingRequest, check_flags, parse_bytes
from tests.deploy.manifests import (REPO, VARIANTS, by_kind, container, one, pod_spec, quantity)

WITH_AUTOSCALING = sorted(v for v, (_, comps) in VARIANTS.items() if "autoscaling-workers" in comps)
METRICS_SOURCE = (REPO / "compute_service" / "server_metrics.py").read_text()


def test_the_gpu_overlay_sizes_kv_from_memory(renders):
    for variant in (v for v, (base, _) in VARIANTS.items() if base == "overlays/gpu"):
        compute = container(renders[variant], "compute", "compute")
        env = {k: compute.env_value(k) for k in compute.env()}
        assert "PREFIXCACHE_DEVICE_PAGES" not in env and "PREFIXCACHE_HOST_PAGES" not in env
        fraction = float(env["PREFIXCACHE_KV_MEMORY_FRACTION"])
        host = parse_bytes(env["PREFIXCACHE_HOST_MEMORY_BYTES"])
        # The values the worker's own flag checks accept (on a CUDA device).
        check_flags(SizingRequest(page_size=16, max_context=1, max_running=1,
                                  kv_memory_fraction=fraction, host_memory_bytes=host), "cuda")
        assert 0.5 <= fraction <= 0.95, "leave the forward some working memory"
        # The pinned host pool lives in the container's memory limit, with room for the weights
        # while they load and the memory-backed /dev/shm.
        limit = quantity(compute.spec["resources"]["limits"]["memory"])
        shm = quantity(compute.volume("dshm")["emptyDir"]["sizeLimit"])
        assert host + shm <= limit * 3 / 4, (host, shm, limit)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_termination_grace_covers_prestop_drain_delay_and_grace(renders, variant):
    compute = container(renders[variant], "compute", "compute")
    pod = pod_spec(one(renders[variant], "Deployment", "compute"))
    prestop = compute.spec["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    need = (float(prestop[1]) + float(compute.env_value("PREFIXCACHE_DRAIN_DELAY_S") or 0)
            + float(compute.env_value("PREFIXCACHE_GRACE_S")))
    # + the abort wait (5 s) and the port flush (2 s) after the grace (compute_service.server).
    assert pod["terminationGracePeriodSeconds"] >= need + 7, (variant, need)


@pytest.mark.parametrize("variant", WITH_AUTOSCALING)
def test_scaled_object_scales_the_compute_deployment_on_worker_metrics(renders, variant):
    docs = renders[variant]
    (scaled,) = by_kind(docs, "ScaledObject")
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    workload = one(docs, "Deployment", target["name"])
    assert any(c["name"] == "compute" for c in pod_spec(workload)["containers"])
    # Never to zero (a worker's cache is the point), and room to grow.
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    assert spec["fallback"]["replicas"] >= spec["minReplicaCount"]
    # No other autoscaler fights KEDA's HPA over the same Deployment.
    assert not [h for h in by_kind(docs, "HorizontalPodAutoscaler")
                if h["spec"]["scaleTargetRef"]["name"] == target["name"]]
    # Scale-in one worker at a time, slowly: each one drains and takes its warm cache along.
    down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert [(p["type"], p["value"]) for p in down["policies"]] == [("Pods", 1)]
    assert down["policies"][0]["periodSeconds"] >= pod_spec(workload)[
        "terminationGracePeriodSeconds"] / 2
    queried = set()
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert float(meta["threshold"]) > 0 and meta["serverAddress"].startswith("http")
        for metric in re.findall(r"\b(prefixcache_compute_\w+)\{", meta["query"]):
            # A gauge the worker exports under that name, in this namespace.
            assert f'"{metric}"' in METRICS_SOURCE, metric
            assert 'namespace="prefixcache"' in meta["query"]
            queried.add(metric)
    assert queried == {"prefixcache_compute_waiting_requests",
                       "prefixcache_compute_kv_device_usage_ratio"}


def test_the_component_reads_metrics_that_monitoring_scrapes():
    """The component's queries need the workers scraped: its variants all add monitoring."""
    assert WITH_AUTOSCALING
    for variant in WITH_AUTOSCALING:
        assert "monitoring" in VARIANTS[variant][1], variant
    text = (Path(REPO) / "deploy" / "k8s" / "components" / "autoscaling-workers" /
            "kustomization.yaml").read_text()
    assert "components/monitoring" in text


def test_scaled_object_schema_rejects_unknown_and_mistyped_fields(renders):
    import copy

    from tests.deploy.manifests import schema_errors
    (scaled,) = by_kind(renders[WITH_AUTOSCALING[0]], "ScaledObject")
    assert schema_errors(scaled, "") == []
    typo = copy.deepcopy(scaled)
    typo["spec"]["maxReplicas"] = 8
    mistyped = copy.deepcopy(scaled)
    mistyped["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA wants strings
    assert schema_errors(typo, "") and schema_errors(mistyped, "")
