"""deploy/k8s/redis.yaml (the optional shared snapshot tier) passes the Kubernetes schemas and
takes its password from the cluster Secret; the password command prints what workers use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from baton.cache.tiers.shared import store_password

ROOT = Path(__file__).resolve().parents[3]
DOCS = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/redis.yaml").read_text()) if d]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_passes_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, "1.31.0", strict=True)


def test_password_comes_from_the_cluster_secret():
    [dep] = [d for d in DOCS if d["kind"] == "Deployment"]
    [c] = dep["spec"]["template"]["spec"]["containers"]
    [env] = c["env"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "baton-cluster", "key": "store-password"}
    assert "--requirepass" in c["args"][-1] and "--maxmemory" in c["args"][-1]


def test_password_command_prints_the_workers_password():
    token = "deploy-redis-test-secret-0123456"
    out = subprocess.run([sys.executable, "-m", "baton.cache.tiers.shared"], text=True,
                         capture_output=True, env={**os.environ, "BATON_CLUSTER_TOKEN": token})
    assert out.stdout.strip() == store_password(token)
