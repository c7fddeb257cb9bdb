"""deploy/k8s/, checked offline: each overlay renders with `kubectl kustomize` and passes
`kubernetes-validate --strict` (the oldest supported Kubernetes and the newest), and the
rendered objects keep the wiring: probes on the standard health service, ports and scrape
annotations that agree with the configuration, the scheduler's worker list, the Secret's keys,
GPUs only in the gpu overlay, and the environment contract of each Sluice container."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_checks import IMAGE_COMMANDS, check_contract, need_tool, tool

from sluice.common.paths import repo_root

K8S = repo_root() / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
# NOTE: native grpc probes are GA since 1.27 and the StatefulSet pod-index label since 1.28.
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")
# The service of each readiness probe. Workers: liveness (""), since the WorkerService turns
# SERVING only when the scheduler warms the worker up, and the scheduler discovers workers
# through the headless Service, which answers ready pods only.
READINESS = {
    "sluice-scheduler": "sluice.v1.GenerationService",
    "sluice-worker": "",
    "sluice-predictor": "sluice.v1.PredictorService",
}
USER_ID = 10001  # USER of every image in deploy/docker/
TLS_FILES = {"SLUICE_TLS_CERT": "tls.crt", "SLUICE_TLS_KEY": "tls.key", "SLUICE_TLS_CA": "ca.crt"}


def render(path: Path) -> str:
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize overlays cannot be rendered here")
    result = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param, render(K8S / "overlays" / request.param)


def objects(text: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(text) if o}


def workloads(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The Sluice Deployments and StatefulSets by name."""
    return {name: o for (kind, name), o in objs.items() if kind in ("Deployment", "StatefulSet") and name in READINESS}


def config_of(objs: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The variables a container gets from its ConfigMaps (envFrom), then its own env values."""
    merged: dict[str, str] = {}
    for source in container.get("envFrom", []):
        merged |= objs["ConfigMap", source["configMapRef"]["name"]]["data"]
    return merged | {e["name"]: e.get("value", "") for e in container.get("env", [])}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_rendered_overlay_passes_strict_kubernetes_validation(
    overlay: tuple[str, str], version: str, tmp_path: Path
) -> None:
    validator = need_tool("kubernetes-validate", "kubernetes-validate")
    name, text = overlay
    rendered = tmp_path / f"{name}.yaml"
    rendered.write_text(text)
    result = subprocess.run(
        [validator, "--strict", "--quiet", "-k", version, str(rendered)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_workers_are_a_statefulset_behind_a_headless_service_the_scheduler_resolves(overlay) -> None:
    objs = objects(overlay[1])
    workers = objs["StatefulSet", "sluice-worker"]
    service = objs["Service", workers["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses", False) is False, "only ready workers are discovered"
    assert service["spec"]["selector"] == workers["spec"]["selector"]["matchLabels"]
    worker_env = config_of(objs, workers["spec"]["template"]["spec"]["containers"][0])
    scheduler = config_of(objs, objs["Deployment", "sluice-scheduler"]["spec"]["template"]["spec"]["containers"][0])
    # NOTE: discovery, not a fixed list: scaling the StatefulSet needs no scheduler restart
    assert "SLUICE_WORKER" not in scheduler
    assert scheduler["SLUICE_WORKERS_DNS"] == f"{service['metadata']['name']}:{worker_env['SLUICE_PORT']}"
    assert float(scheduler["SLUICE_WORKERS_DNS_REFRESH_S"]) > 0


def test_the_scheduler_asks_the_predictor_through_its_service(overlay) -> None:
    objs = objects(overlay[1])
    scheduler = config_of(objs, objs["Deployment", "sluice-scheduler"]["spec"]["template"]["spec"]["containers"][0])
    predictor = objs["Deployment", "sluice-predictor"]["spec"]["template"]["spec"]["containers"][0]
    service = objs["Service", "sluice-predictor"]["spec"]
    assert service["selector"] == objs["Deployment", "sluice-predictor"]["spec"]["selector"]["matchLabels"]
    port = int(config_of(objs, predictor)["SLUICE_PORT"])
    assert service["ports"][0]["port"] == port
    assert scheduler["SLUICE_PREDICTOR"] == f"sluice-predictor:{port}"
    redis = config_of(objs, predictor)["SLUICE_REDIS_URL"]
    assert redis.startswith("redis://redis:") and ("Service", "redis") in objs


def test_one_scheduler_replaced_by_recreate(overlay) -> None:
    scheduler = objects(overlay[1])["Deployment", "sluice-scheduler"]["spec"]
    assert scheduler["replicas"] == 1 and scheduler["strategy"] == {"type": "Recreate"}


def test_grpc_probes_use_liveness_and_the_services_readiness_on_its_port(overlay) -> None:
    objs = objects(overlay[1])
    for name, workload in workloads(objs).items():
        container = workload["spec"]["template"]["spec"]["containers"][0]
        port = int(config_of(objs, container)["SLUICE_PORT"])
        assert container["ports"][0] == {"name": "grpc", "containerPort": port}, name
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": port}, f"{name} {probe}: liveness is the '' service"
        expected = {"port": port, "service": READINESS[name]} if READINESS[name] else {"port": port}
        assert container["readinessProbe"]["grpc"] == expected, name


def test_scrape_annotations_name_each_services_metrics_port(overlay) -> None:
    objs = objects(overlay[1])
    for name, workload in workloads(objs).items():
        template = workload["spec"]["template"]
        metrics = config_of(objs, template["spec"]["containers"][0])["SLUICE_METRICS_PORT"]
        notes = template["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics", name
        assert notes["prometheus.io/port"] == metrics, name
        assert {"name": "metrics", "containerPort": int(metrics)} in template["spec"]["containers"][0]["ports"]


def test_pods_run_as_the_images_non_root_user(overlay) -> None:
    for name, workload in workloads(objects(overlay[1])).items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == USER_ID, name
        assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False, name


def test_the_api_key_comes_from_the_secret_and_its_files_are_mounted(overlay) -> None:
    objs = objects(overlay[1])
    secrets = [o for (kind, _), o in objs.items() if kind == "Secret"]
    assert len(secrets) == 1
    secret = secrets[0]
    assert set(secret["data"]) == {"api-key", "tls.crt", "tls.key", "ca.crt"}
    for name, workload in workloads(objs).items():
        pod = workload["spec"]["template"]["spec"]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        ref = env["SLUICE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"], name
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == secret["metadata"]["name"], name
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["tls"]["mountPath"] == "/etc/sluice/tls" and mounts["tls"]["readOnly"] is True, name


def test_gpus_are_requested_in_the_gpu_overlay_only(overlay) -> None:
    name, text = overlay
    objs = objects(text)
    worker = objs["StatefulSet", "sluice-worker"]["spec"]["template"]["spec"]
    container = worker["containers"][0]
    device = config_of(objs, container)["SLUICE_DEVICE"]
    if name == "gpu":
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["image"].startswith("sluice-worker-cuda:") and device == "cuda"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in worker["tolerations"]
    else:
        assert "nvidia.com/gpu" not in text
        assert container["image"].startswith("sluice-worker-cpu:") and device == "cpu"
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]


def test_disruption_budgets_cover_workers_and_predictors(overlay) -> None:
    objs = objects(overlay[1])
    budgets = {name: o["spec"] for (kind, name), o in objs.items() if kind == "PodDisruptionBudget"}
    assert budgets["sluice-worker"]["maxUnavailable"] == 1
    assert budgets["sluice-predictor"]["minAvailable"] == 1
    for name, spec in budgets.items():
        assert spec["selector"]["matchLabels"] == workloads(objs)[name]["spec"]["selector"]["matchLabels"]


def test_every_image_is_built_by_a_dockerfile(overlay) -> None:
    for name, workload in workloads(objects(overlay[1])).items():
        image = workload["spec"]["template"]["spec"]["containers"][0]["image"].split(":")[0]
        assert (repo_root() / "deploy" / "docker" / f"{image.removeprefix('sluice-')}.Dockerfile").is_file(), name


def test_every_variable_is_a_flag_of_the_containers_command(overlay) -> None:
    objs = objects(overlay[1])
    services = []
    for workload in workloads(objs).values():
        container = workload["spec"]["template"]["spec"]["containers"][0]
        command = IMAGE_COMMANDS[container["image"].removeprefix("sluice-").split(":")[0].split("-")[0]]
        services.append((command, set(config_of(objs, container))))
    check_contract(services)


def test_the_gateway_is_a_stateless_http_deployment_wired_to_the_scheduler(overlay) -> None:
    objs = objects(overlay[1])
    deployment = objs["Deployment", "sluice-gateway"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = config_of(objs, container)
    port = int(env["SLUICE_PORT"])
    scheduler = objs["Service", "sluice-scheduler"]["spec"]["ports"][0]["port"]
    assert env["SLUICE_SCHEDULER"] == f"sluice-scheduler:{scheduler}" and env["SLUICE_HOST"] == "0.0.0.0"
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["tcpSocket"] == {"port": "http"}, "a scheduler restart restarts no gateway"
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert (notes["prometheus.io/port"], notes["prometheus.io/path"]) == (str(port), "/metrics")
    assert pod["securityContext"]["runAsUser"] == USER_ID and pod["securityContext"]["runAsNonRoot"] is True
    key = {e["name"]: e for e in container["env"]}["SLUICE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key["key"] == "api-key", "the same key as the scheduler's gRPC API"
    service = objs["Service", "sluice-gateway"]["spec"]
    assert service["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert container["image"].startswith("sluice-gateway:")
    assert (repo_root() / "deploy" / "docker" / "gateway.Dockerfile").is_file()
    check_contract([(IMAGE_COMMANDS["gateway"], set(env))])


def test_the_tls_component_serves_the_gateway_over_https_and_dials_the_scheduler_over_tls(tmp_path: Path) -> None:
    base = os.path.relpath(K8S / "overlays" / "cpu", tmp_path)
    component = os.path.relpath(K8S / "components" / "tls", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{base}]\ncomponents: [{component}]\n")
    objs = objects(render(tmp_path))
    container = objs["Deployment", "sluice-gateway"]["spec"]["template"]["spec"]["containers"][0]
    env = config_of(objs, container)
    assert (env["SLUICE_TLS_CERT"], env["SLUICE_TLS_KEY"]) == ("/etc/sluice/tls/tls.crt", "/etc/sluice/tls/tls.key")
    assert "SLUICE_TLS_CA" not in env, "HTTPS clients show the API key, not a certificate: probes can reach it"
    assert (env["SLUICE_SCHEDULER_TLS"], env["SLUICE_SCHEDULER_TLS_CA"]) == ("true", "/etc/sluice/tls/ca.crt")
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


def test_the_tls_component_points_every_service_at_the_mounted_secret_files(tmp_path: Path) -> None:
    base = os.path.relpath(K8S / "overlays" / "cpu", tmp_path)
    component = os.path.relpath(K8S / "components" / "tls", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{base}]\ncomponents: [{component}]\n")
    objs = objects(render(tmp_path))
    secret_keys = next(o["data"] for (kind, _), o in objs.items() if kind == "Secret")
    for name, workload in workloads(objs).items():
        env = config_of(objs, workload["spec"]["template"]["spec"]["containers"][0])
        for variable, key in TLS_FILES.items():
            assert env[variable] == f"/etc/sluice/tls/{key}" and key in secret_keys, name
