"""One deployment description for both drivers (scheduler_service/cluster/deployment.py): one
default and one meaning per setting, the same cluster from the same description, and the TBT
SLO a request is held to resolved once (core/slo.py) and followed by Sarathi's tau."""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import pytest
from harness import make_request

from scheduler_service.cluster import build_cluster
from scheduler_service.cluster.deployment import SYNCHRONOUS_UNBOUNDED, Deployment
from scheduler_service.cluster.spec import ClusterSpec, WorkerSpec
from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.slo import SLOClass, SLOSpec, TbtSloSet, request_tbt_slo, tightest_tbt_slo
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.live.config import LiveConfig
from scheduler_service.live.remote import WorkerCapacity
from scheduler_service.live.service import cluster_spec as live_cluster_spec
from scheduler_service.policies.sarathi.policy import SarathiPolicy, budget_from_tbt_slo
from scheduler_service.sim.capacity import parse_rule
from scheduler_service.sim.simulator import SimConfig, Simulation
from scheduler_service.workloads import TraceRequest, Workload

MODEL, HARDWARE = "llama-2-7b", "a100-80g"


def _default(f: dataclasses.Field) -> object:
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


@pytest.mark.parametrize("config", [LiveConfig, SimConfig])
def test_every_shared_setting_has_the_descriptions_default_and_help_in_both_drivers(config: type) -> None:
    """A shared setting redefined in one driver's config (another default, another meaning)
    would fail here; changing a default in `Deployment` changes it live and simulated."""
    theirs = {f.name: f for f in fields(config)}
    for f in fields(Deployment):
        assert _default(theirs[f.name]) == _default(f), f.name
        assert theirs[f.name].metadata["help"] == f.metadata["help"], f.name


def test_the_defaults_describe_the_service_and_the_papers_engine_is_a_named_setting() -> None:
    d = Deployment()
    assert (d.overlap, d.max_waiting, d.max_offline_waiting) == (True, 256, 4096)
    bare = ClusterSpec("vllm", (WorkerSpec(8, 0),), build_cost_model("analytic", MODEL, HARDWARE), 2048)
    assert {k: getattr(bare, k) for k in SYNCHRONOUS_UNBOUNDED} == SYNCHRONOUS_UNBOUNDED


def _live_and_simulated(description: Deployment) -> tuple[ClusterSpec, ClusterSpec]:
    """The ClusterSpec each driver builds: the simulator from its cost model's KV arithmetic,
    the live scheduler from what its workers would answer (the same KV)."""
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    sim = Simulation(
        SimConfig(**{**asdict(description), "max_model_len": 4096}, num_workers=2, kv_gb=2.0),
        Workload("none", [TraceRequest("r0", 0.0, 8, 4)]),
        cm,
    )
    simulated = sim.cluster.spec
    w = simulated.workers[0]
    caps = [
        WorkerCapacity(
            MODEL, 4096, 32000, (2,), w.block_size, w.num_gpu_blocks, w.num_cpu_blocks, "mixed", cm.model, cm.hardware
        )
        for _ in range(2)
    ]
    return live_cluster_spec(LiveConfig(**asdict(description)), caps, 4096), simulated


@pytest.mark.parametrize(
    "description",
    [
        Deployment(policy="sarathi"),
        Deployment(policy="accelgen", tbt_slo_s=0.05, max_num_seqs=64, max_num_batched_tokens=4096),
        Deployment(policy="alise", overlap=False, max_waiting=None, max_offline_waiting=0, queue_timeout_s=3.0),
        Deployment(policy="econoserve", prefix_caching=False, int8_swap=False, swap_space_gib=2.0),
    ],
    ids=["defaults", "slo-and-limits", "papers-engine", "kv-options"],
)
def test_the_same_description_gives_the_same_cluster_and_policy_context_in_both_drivers(
    description: Deployment,
) -> None:
    live, simulated = _live_and_simulated(description)
    for name in (
        "policy",
        "router",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_waiting",
        "queue_timeout_s",
        "tbt_slo_s",
        "int8_swap",
        "prefix_caching",
        "overlap",
        "max_offline_waiting",
        "int8_transfer",
        "workers",
        "max_model_len",
    ):
        assert getattr(live, name) == getattr(simulated, name), name
    for w in (0, 1):
        assert dataclasses.replace(live.policy_context(w), cost_model=None) == dataclasses.replace(
            simulated.policy_context(w), cost_model=None
        )
    assert live.scheduler_config() == simulated.scheduler_config()


def test_max_waiting_bounds_the_whole_cluster_not_each_worker() -> None:
    """Five requests, a bound of 2 on two workers: three refused (a per-worker bound would
    have taken four). Both drivers submit through this Cluster."""
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    cluster = build_cluster(ClusterSpec("vllm", (WorkerSpec(64, 0),) * 2, cm, 2048, max_waiting=2))
    refused = [cluster.submit(make_request(f"r{i}", 16, 4), 0.0) for i in range(5)]
    assert refused == [None, None, RejectReason.QUEUE_FULL, RejectReason.QUEUE_FULL, RejectReason.QUEUE_FULL]
    assert cluster.num_waiting == 2


def test_the_simulator_refuses_beyond_the_bound_as_the_live_scheduler_does() -> None:
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    burst = Workload("burst", [TraceRequest(f"r{i}", 0.0, 512, 64) for i in range(40)])
    bounded = Simulation(SimConfig(max_waiting=4, kv_gb=2.0, max_model_len=4096), burst, cm).run()
    unbounded = Simulation(SimConfig(max_waiting=None, kv_gb=2.0, max_model_len=4096), burst, cm).run()
    refused = bounded.details["rejected_by_reason"].get("queue_full", 0)
    assert refused > 0 and bounded.metrics["num_finished"] + refused == 40
    assert unbounded.metrics["num_finished"] == 40 and not unbounded.details["rejected_by_reason"]
    # a capacity search must not take a rate the bound kept short for a sustained one
    lenient = parse_rule("norm_latency:1000")
    assert lenient.holds(unbounded, None) and not lenient.holds(bounded, None)


def test_a_requests_tbt_slo_is_its_own_else_the_deployments_and_none_when_offline() -> None:
    assert request_tbt_slo(SLOSpec(tbt_s=0.05), 0.2) == 0.05
    assert request_tbt_slo(SLOSpec(ttft_s=1.0), 0.2) == 0.2
    assert request_tbt_slo(SLOSpec(), None) is None
    assert request_tbt_slo(SLOSpec(jct_s=30.0), 0.2) is None  # judged by JCT alone
    assert request_tbt_slo(SLOSpec(tbt_s=0.05, slo_class=SLOClass.OFFLINE), 0.2) is None
    assert tightest_tbt_slo([SLOSpec(tbt_s=0.3), SLOSpec(), SLOSpec(tbt_s=0.1)], 0.2) == 0.1
    assert tightest_tbt_slo([SLOSpec(jct_s=5.0)], 0.2) == 0.2


def test_the_tightest_tbt_slo_follows_requests_as_they_come_and_go() -> None:
    slos = TbtSloSet(0.2)
    assert slos.tightest == 0.2
    assert slos.add("a", SLOSpec(tbt_s=0.5)) and slos.tightest == 0.5
    assert slos.add("b", SLOSpec(tbt_s=0.05)) and slos.tightest == 0.05
    assert not slos.add("c", SLOSpec(tbt_s=0.05)) and not slos.add("d", SLOSpec(jct_s=9.0))
    assert not slos.remove("b") and slos.tightest == 0.05  # c still holds it
    assert slos.remove("c") and slos.tightest == 0.5
    assert slos.remove("a") and slos.tightest == 0.2  # none held: the deployment's
    assert not slos.remove("never-added")


def test_sarathi_sizes_tau_by_the_tightest_client_slo_on_its_worker() -> None:
    """No deployment SLO: tau is the paper's 512 until a client brings a TBT SLO, then the
    largest forward within the tightest SLO held, and back when those requests leave."""
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    spec = ClusterSpec("sarathi", (WorkerSpec(4096, 0),), cm, 4096)
    policy = SarathiPolicy(SarathiPolicy.config_cls(), spec.policy_context(0))
    assert policy.token_budget(0.0) == 512
    loose, tight = (
        make_request("loose", 64, 8, slo=SLOSpec(tbt_s=0.2)),
        make_request("tight", 64, 8, slo=SLOSpec(tbt_s=0.05)),
    )
    policy.on_arrival(loose, 0.0)
    assert policy.token_budget(0.0) == budget_from_tbt_slo(cm, 0.2, 128)
    policy.on_arrival(tight, 0.0)
    assert policy.token_budget(0.0) == budget_from_tbt_slo(cm, 0.05, 128) < budget_from_tbt_slo(cm, 0.2, 128)
    policy.on_finished(tight, 1.0)
    assert policy.token_budget(0.0) == budget_from_tbt_slo(cm, 0.2, 128)
    policy.on_finished(loose, 2.0)
    assert policy.token_budget(0.0) == 512


def test_sluice_simulate_runs_a_deployment_by_default_and_the_papers_engine_when_asked(tmp_path: Path) -> None:
    """`--paper-setting` is the papers' engine; a flag given explicitly still wins."""
    import json

    from services.cli import main

    base = ["simulate", "--trace", "sharegpt", "--num-requests", "8", "--rate", "2", "--no-progress"]
    seen = {}
    for name, extra in {
        "default": [],
        "papers": ["--paper-setting"],
        "papers+overlap": ["--paper-setting", "--overlap"],
    }.items():
        out = tmp_path / f"{name}.json"
        assert main([*base, *extra, "--json", str(out)]) == 0
        config = json.loads(out.read_text())["config"]
        seen[name] = tuple(config[k] for k in ("overlap", "max_waiting", "max_offline_waiting", "swap_space_gib"))
    assert seen == {
        "default": (True, 256, 4096, None),
        "papers": (False, None, 0, 16.0),
        "papers+overlap": (True, None, 0, 16.0),
    }
