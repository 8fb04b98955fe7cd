"""deploy/k8s renders with `kubectl kustomize`, validates against the Kubernetes schemas offline, and holds
together: selectors match, probes hit the gateway's endpoints, the pod runs non-root on a read-only root
filesystem, and the config it mounts passes `hetgate check-config`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("base", "overlays/amd-mixed", "overlays/single")
K8S_VERSION = "1.37.0"
Render = Callable[[str], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def render(kubectl: str) -> Callable[[str], list[dict[str, Any]]]:
    cache: dict[str, list[dict[str, Any]]] = {}

    def rendered(path: str) -> list[dict[str, Any]]:
        if path not in cache:
            out = subprocess.run(
                [kubectl, "kustomize", str(K8S / path)],
                check=True,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            cache[path] = [doc for doc in yaml.safe_load_all(out) if doc]
        return cache[path]

    return rendered


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"].startswith(name):
            return doc
    raise AssertionError(f"{kind}/{name} not rendered")


@pytest.mark.parametrize("path", OVERLAYS)
def test_every_resource_validates_strictly(render: Render, path: str) -> None:
    docs = render(path)
    assert docs
    for doc in docs:
        # Raises ValidationError on a wrong field, type or missing required value.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", OVERLAYS)
def test_config_map_passes_check_config(render: Render, path: str, tmp_path: Path) -> None:
    config = find(render(path), "ConfigMap", "hetgate-config")["data"]["config.yaml"]
    file = tmp_path / "config.yaml"
    file.write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", str(file)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", OVERLAYS)
def test_gateway_pod_is_probed_hardened_and_selected(render: Render, path: str) -> None:
    docs = render(path)
    deployment = find(docs, "Deployment", "hetgate")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = find(docs, "Service", "hetgate")
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"]["cpu"]
    mounted = {m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert mounted <= volumes.keys()
    config_map = find(docs, "ConfigMap", "hetgate-config")["metadata"]["name"]
    assert volumes["config"]["configMap"]["name"] == config_map  # kustomize's hashed name is wired in


def test_replicated_base_has_disruption_budget_and_shared_index(render: Render) -> None:
    docs = render("overlays/amd-mixed")
    deployment = find(docs, "Deployment", "hetgate")
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pdb = find(docs, "PodDisruptionBudget", "hetgate")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    config = yaml.safe_load(find(docs, "ConfigMap", "hetgate-config")["data"]["config.yaml"])
    assert config["index"]["store"] == "redis"
    redis_service = find(docs, "Service", "hetgate-redis")["metadata"]["name"]
    assert f"//{redis_service}:" in config["index"]["redis_url"]
    role = find(docs, "Role", "hetgate-discovery")
    granted = {(r["apiGroups"][0], res): set(r["verbs"]) for r in role["rules"] for res in r["resources"]}
    assert {"list", "watch"} <= granted[("discovery.k8s.io", "endpointslices")]
    assert {"list", "watch"} <= granted[("", "pods")]


def test_model_servers_match_the_backend_list(render: Render) -> None:
    """Every backend in the AMD overlay's config is a pod of a StatefulSet labelled with the same
    accelerator and serving the NIXL connector the config names."""
    docs = render("overlays/amd-mixed")
    config = yaml.safe_load(find(docs, "ConfigMap", "hetgate-config")["data"]["config.yaml"])
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    for backend in config["backends"]:
        host = backend["url"].split("//", 1)[1].split(":", 1)[0]  # <set>-<ordinal>.<service>
        pod_name, service = host.split(".", 1)
        set_name, ordinal = pod_name.rsplit("-", 1)
        stateful = sets[set_name]
        assert stateful["spec"]["serviceName"] == service
        assert int(ordinal) < stateful["spec"]["replicas"]
        template = stateful["spec"]["template"]
        assert template["metadata"]["labels"]["hetgate.io/accelerator"] == backend["accelerator"]
        assert int(template["metadata"]["labels"]["hetgate.io/gpus"]) == backend["gpus"]
        roles = set(template["metadata"]["annotations"]["hetgate.io/roles"].split(","))
        assert roles == set(backend["roles"])
        args = " ".join(template["spec"]["containers"][0]["args"])
        assert "NixlConnector" in args and backend["kv_connector"] == "nixl"
        assert "--enable-prompt-tokens-details" in args
