"""deploy/k8s: the manifests pass the Kubernetes schemas (offline, a pinned version) and keep
the rules the cluster depends on: the secret from a Secret, gRPC health probes, GPUs where the
config asks for CUDA."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from baton.config import BatonConfig

ROOT = Path(__file__).resolve().parents[3]
K8S_VERSION = "1.31.0"
DOCS = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/baton.yaml").read_text()) if d]


def _containers():
    for d in DOCS:
        if d["kind"] == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d["metadata"]["name"], c


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_passes_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any violation


def test_the_manifests_are_one_router_two_worker_roles_and_their_config():
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in DOCS)
    assert kinds == [("ConfigMap", "baton-config"), ("Deployment", "baton-decode"),
                     ("Deployment", "baton-prefill"), ("Deployment", "baton-router"),
                     ("Service", "baton-router")]


def test_every_process_reads_the_cluster_secret_from_a_secret():
    for name, c in _containers():
        env = {e["name"]: e for e in c.get("env", [])}
        ref = env["BATON_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("baton-cluster", "token"), name
        assert "--token" not in " ".join(map(str, c["args"])), name


def test_workers_are_ready_by_their_grpc_health_service():
    for name, c in _containers():
        probe = c["readinessProbe"] if name != "baton-router" else c["livenessProbe"]
        assert "grpc" in probe, name


def test_gpus_are_requested_exactly_where_the_config_asks_for_cuda():
    config = next(d for d in DOCS if d["kind"] == "ConfigMap")["data"]["config.yaml"]
    device = BatonConfig.from_dict(yaml.safe_load(config)).model.device
    for name, c in _containers():
        if name == "baton-router":
            continue
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus is not None) == device.startswith("cuda"), (name, device, gpus)


PP_DOCS = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/baton-pp.yaml").read_text()) if d]


@pytest.mark.parametrize("doc", PP_DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_the_pp_prefill_example_passes_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_pp_prefill_example_puts_its_two_stages_on_two_nodes():
    sts = next(d for d in PP_DOCS if d["kind"] == "StatefulSet")
    spec = sts["spec"]["template"]["spec"]
    assert sts["spec"]["replicas"] == 2
    rule = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    (c,) = spec["containers"]
    args = " ".join(c["args"])
    assert "--pipeline-parallel-size 2 --pp-rank $PP_RANK --pp-master baton-prefill-pp-0." in args
    env = {e["name"]: e for e in c["env"]}
    assert "pod-index" in env["PP_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    ref = env["BATON_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("baton-cluster", "token")
