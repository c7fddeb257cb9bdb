"""docker-compose.yml, checked offline: the compose schema, the references the schema cannot
see (depends_on targets, health-gated targets with a health check, Dockerfiles, mounted
files), the wiring between services (worker addresses, metrics ports, OpenTelemetry), and the
environment contract of each Sluice service."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_checks import check_contract, need_tool, probe_command

from sluice.common.paths import repo_root

COMPOSE = repo_root() / "docker-compose.yml"
# The service each health check asks for. Workers: liveness, since they turn ready only when
# the scheduler warms them up, and the scheduler starts once their check passes.
SERVICE_NAMES = {
    "scheduler": "sluice.v1.GenerationService",
    "worker": "",
    "predictor": "sluice.v1.PredictorService",
    "gateway": "/health",  # HTTP: 200 while the scheduler has a worker ready
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def sluice_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if s.get("image", "").startswith("sluice-")}


def kind(service: dict[str, Any]) -> str:
    """scheduler, worker or predictor, from the image name sluice-<kind>[-variant]:tag."""
    return service["image"].removeprefix("sluice-").split(":")[0].split("-")[0]


def entrypoint(service: dict[str, Any]) -> tuple[str, ...]:
    text = (repo_root() / service["build"]["dockerfile"]).read_text()
    words = re.search(r'^ENTRYPOINT \["sluice", (.*)\]$', text, re.M).group(1)  # type: ignore[union-attr]
    return tuple(w.strip().strip('"') for w in words.split(","))


def test_the_compose_schema_accepts_it() -> None:
    checker = need_tool("check-jsonschema", "check-jsonschema")
    result = subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_depends_on_names_services_and_health_gates_only_services_with_a_health_check(compose) -> None:
    services = compose["services"]
    for name, service in services.items():
        for target, rule in service.get("depends_on", {}).items():
            assert target in services, f"{name} depends on {target}, which is not a service"
            if rule["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target}'s health, which has no check"
    scheduler = services["scheduler"]["depends_on"]
    assert {t for t, r in scheduler.items() if r["condition"] == "service_healthy"} == {
        "worker-1",
        "worker-2",
        "worker-1-gpu",
        "worker-2-gpu",
        "predictor",
    }
    assert services["predictor"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"


def test_the_gateway_dials_the_scheduler_at_its_port(compose) -> None:
    services = compose["services"]
    assert (
        services["gateway"]["environment"]["SLUICE_SCHEDULER"]
        == f"scheduler:{services['scheduler']['environment']['SLUICE_PORT']}"
    )


def test_cpu_workers_by_default_and_gpu_workers_instead_under_the_gpu_profile(compose) -> None:
    services = compose["services"]
    env_file = (repo_root() / ".env").read_text()
    assert re.search(r"^COMPOSE_PROFILES=cpu$", env_file, re.M)
    profiled = {name: s["profiles"] for name, s in services.items() if "profiles" in s}
    assert profiled == {"worker-1": ["cpu"], "worker-2": ["cpu"], "worker-1-gpu": ["gpu"], "worker-2-gpu": ["gpu"]}
    for cpu_name in ("worker-1", "worker-2"):
        gpu = services[f"{cpu_name}-gpu"]
        assert gpu["networks"]["default"]["aliases"] == [cpu_name], "the scheduler dials the same names"
        devices = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert services[cpu_name]["environment"]["SLUICE_DEVICE"] == "cpu" and "deploy" not in services[cpu_name]
        assert gpu["environment"]["SLUICE_DEVICE"] == "cuda" and gpu["image"].startswith("sluice-worker-cuda:")
    gpu_ids = [services[f"worker-{i}-gpu"]["deploy"]["resources"]["reservations"]["devices"][0] for i in (1, 2)]
    assert gpu_ids[0]["device_ids"] != gpu_ids[1]["device_ids"], "two workers, two GPUs by default"


def test_the_scheduler_dials_every_worker_at_its_port(compose) -> None:
    services = compose["services"]
    dialled = services["scheduler"]["environment"]["SLUICE_WORKER"].split(",")
    workers = {n: s for n, s in sluice_services(compose).items() if kind(s) == "worker" and s["profiles"] == ["cpu"]}
    assert sorted(dialled) == sorted(f"{n}:{s['environment']['SLUICE_PORT']}" for n, s in workers.items())


def test_the_scheduler_asks_the_predictor_which_uses_redis(compose) -> None:
    services = compose["services"]
    predictor = services["predictor"]["environment"]
    assert services["scheduler"]["environment"]["SLUICE_PREDICTOR"] == f"predictor:{predictor['SLUICE_PORT']}"
    assert services["scheduler"]["depends_on"]["predictor"]["condition"] == "service_healthy"
    assert predictor["SLUICE_REDIS_URL"].startswith("redis://redis:6379/")
    assert services["predictor"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_every_sluice_service_listens_beyond_loopback_and_checks_its_own_readiness(compose) -> None:
    for name, service in sluice_services(compose).items():
        env = service["environment"]
        assert env["SLUICE_HOST"] == "0.0.0.0", name
        assert service["healthcheck"]["test"] == ["CMD", *probe_command(SERVICE_NAMES[kind(service)])], name
        assert (repo_root() / service["build"]["dockerfile"]).is_file(), name
        assert service["image"].split(":")[0] == "sluice-" + Path(service["build"]["dockerfile"]).stem


def test_traces_go_to_the_collector_and_on_to_jaeger(compose) -> None:
    for name, service in sluice_services(compose).items():
        env = service["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
        assert env["OTEL_TRACES_EXPORTER"] == "otlp" and env["OTEL_SERVICE_NAME"] == f"sluice-{kind(service)}", name
    collector = yaml.safe_load((repo_root() / "deploy" / "otel" / "collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert [collector["exporters"][e]["endpoint"] for e in pipeline["exporters"]] == ["jaeger:4317"]
    assert compose["services"]["jaeger"]["image"].startswith("jaegertracing/")


def test_prometheus_scrapes_every_sluice_service_at_its_metrics_port(compose) -> None:
    config = yaml.safe_load((repo_root() / "deploy" / "prometheus" / "prometheus.yml").read_text())
    scraped = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    # NOTE: the gateway has no metrics port of its own: its /metrics is on its HTTP port
    expected = {
        f"{name}:{s['environment'].get('SLUICE_METRICS_PORT') or s['environment']['SLUICE_PORT']}"
        for name, s in sluice_services(compose).items()
        if s.get("profiles", ["cpu"]) == ["cpu"]  # the GPU workers answer to the CPU workers' names
    }
    assert scraped == expected


def test_mounted_files_exist_and_named_volumes_are_declared(compose) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (repo_root() / source).is_file(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in compose["volumes"], f"{name} uses volume {source}, which is not declared"
    assert set(compose["volumes"]) == {"model-weights", "predictor-artifacts"}


def test_every_variable_is_a_flag_of_the_services_command(compose) -> None:
    check_contract([(entrypoint(s), set(s["environment"])) for s in sluice_services(compose).values()])
