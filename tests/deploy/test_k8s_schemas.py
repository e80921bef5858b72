"""Every rendering is schema-valid in strict mode (unknown fields are errors), for the oldest and
the newest supported Kubernetes: built-in kinds against the kubernetes-validate schema set,
custom resources against tests/deploy/schemas/."""
from __future__ import annotations

import copy

import pytest

from tests.deploy.manifests import (NAMESPACE, VARIANTS, SchemaMissing, by_kind, is_builtin,
                                    kubernetes_version, one, schema_errors)

EXPECTED = {  # (kind, name) that every rendering must contain
    ("Namespace", NAMESPACE),
    ("Deployment", "gateway"), ("Service", "gateway"), ("HorizontalPodAutoscaler", "gateway"),
    ("PodDisruptionBudget", "gateway"), ("ServiceAccount", "gateway"),
    ("Deployment", "compute"), ("Service", "compute-headless"), ("Service", "cache-headless"),
    ("PodDisruptionBudget", "compute"), ("ServiceAccount", "compute"),
    ("StatefulSet", "redis"), ("Service", "redis"), ("Service", "redis-headless"),
    ("PodDisruptionBudget", "redis"), ("ServiceAccount", "redis"),
    ("NetworkPolicy", "default-deny-all"), ("NetworkPolicy", "allow-dns-egress"),
}


def test_every_variant_renders_the_whole_system(docs):
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "duplicate resources"
    assert EXPECTED <= set(names), sorted(EXPECTED - set(names))


def test_every_namespaced_resource_is_in_the_namespace(docs):
    for d in docs:
        if d["kind"] in ("Namespace",):
            continue
        assert d["metadata"].get("namespace") == NAMESPACE, (d["kind"], d["metadata"]["name"])


def test_components_add_their_resources(renders):
    for name, docs in renders.items():
        components = VARIANTS[name][1]
        assert bool(by_kind(docs, "ServiceMonitor")) == ("monitoring" in components), name
        assert bool(by_kind(docs, "PrometheusRule")) == ("monitoring" in components), name
        assert bool(by_kind(docs, "Certificate")) == ("mtls" in components), name
        assert bool(by_kind(docs, "InferencePool")) == ("inference-extension" in components), name
        assert bool(by_kind(docs, "ScaledObject")) == ("autoscaling-workers" in components), name


@pytest.mark.parametrize("which", ["oldest", "newest"])
def test_strict_schema_validation(docs, which):
    version = kubernetes_version(which)
    problems = []
    for d in docs:
        try:
            errors = schema_errors(d, version)
        except SchemaMissing as exc:
            problems.append(str(exc))
            continue
        problems += [f"{d['kind']}/{d['metadata']['name']}: {e}" for e in errors]
    assert not problems, f"Kubernetes {version}:\n" + "\n".join(problems)


def test_custom_resources_are_only_the_known_ones(renders):
    custom = {(d["apiVersion"], d["kind"]) for docs in renders.values() for d in docs
              if not is_builtin(d)}
    assert custom == {("monitoring.coreos.com/v1", "ServiceMonitor"),
                      ("monitoring.coreos.com/v1", "PrometheusRule"),
                      ("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate"),
                      ("inference.networking.k8s.io/v1", "InferencePool"),
                      ("gateway.networking.k8s.io/v1", "HTTPRoute"),
                      ("keda.sh/v1alpha1", "ScaledObject")}


# Negative controls: the validators really are strict, so a green run means something.

def test_validator_rejects_unknown_and_mistyped_fields(renders):
    version = kubernetes_version("oldest")
    deployment = one(renders["gpu"], "Deployment", "compute")
    assert schema_errors(deployment, version) == []
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    assert schema_errors(typo, version)
    mistyped = copy.deepcopy(deployment)
    mistyped["spec"]["replicas"] = "four"
    assert schema_errors(mistyped, version)


def test_crd_validator_rejects_unknown_fields(renders):
    docs = renders["gpu+monitoring+mtls"]
    monitor = copy.deepcopy(by_kind(docs, "ServiceMonitor")[0])
    certificate = copy.deepcopy(by_kind(docs, "Certificate")[0])
    assert schema_errors(monitor, "") == [] and schema_errors(certificate, "") == []
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    certificate["spec"]["usages"].append("server-auth")
    assert schema_errors(monitor, "") and schema_errors(certificate, "")
