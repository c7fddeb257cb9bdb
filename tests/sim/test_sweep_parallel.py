"""The harness's sweep runner: a sweep's independent simulations give the same results, in the
same order, serially, in local processes and as Ray tasks (skipped where Ray is not installed)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from sluice_bench.options import Parallelism
from sluice_bench.repro import PAPERS, Setup, run_one
from sluice_bench.sweep import run_sweep, run_tasks

CLAIM = PAPERS["sarathi"]()[0]
SETUP = Setup(duration_s=20.0, warmup=0.2, min_requests=20)


def one_run(point: tuple[str, float], seed: int) -> dict[str, Any]:
    label, rate = point
    system = next(s for s in CLAIM.systems if s.label == label)
    return run_one(CLAIM, system, rate, seed, SETUP)


POINTS = [(s.label, rate) for s in CLAIM.systems for rate in (0.5, 2.0)]
SEEDS = [0, 1]


@pytest.fixture(scope="module")
def serial() -> list[dict[str, Any]]:
    return run_sweep(one_run, POINTS, SEEDS, Parallelism(jobs=1), progress=False)


def test_the_serial_sweep_is_point_major_and_its_seeds_differ(serial: list[dict[str, Any]]) -> None:
    assert [(r["system"], r["rate"], r["seed"]) for r in serial] == [(*p, s) for p in POINTS for s in SEEDS]
    assert serial[0]["num_requests"] > 0 and serial[0] != serial[1]  # another seed, another draw


def test_local_processes_give_the_serial_results(serial: list[dict[str, Any]]) -> None:
    parallel = run_sweep(one_run, POINTS, SEEDS, Parallelism(jobs=2), progress=False)
    assert parallel == serial
    assert json.dumps(parallel, sort_keys=True) == json.dumps(serial, sort_keys=True)


def test_a_failing_run_fails_the_sweep() -> None:
    with pytest.raises(ZeroDivisionError):
        run_tasks(divmod, [(1, 1), (1, 0)], Parallelism(jobs=2), progress=False)


def test_ray_tasks_give_the_serial_results(serial: list[dict[str, Any]]) -> None:
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    try:
        on_ray = run_sweep(one_run, POINTS, SEEDS, Parallelism(ray_address="local"), progress=False)
    finally:
        ray.shutdown()
    assert json.dumps(on_ray, sort_keys=True) == json.dumps(serial, sort_keys=True)
