"""The harness's sweep runner: a sweep's independent simulations give the same results, in the
same order, serially, in local processes and as Ray tasks (skipped where Ray is not installed)."""

from __future__ import annotations

import json
import os
import signal
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


_FAISS_AFTER_FORK = """
import numpy as np, faiss
from sluice_bench.options import Parallelism
from sluice_bench.sweep import run_tasks
from tests.sim.test_sweep_parallel import faiss_search
base = np.random.default_rng(0).random((20000, 64), dtype=np.float32)
index = faiss.IndexFlatIP(64)
index.add(base)
index.search(base[:64], 5)  # the parent's OpenMP thread pool now exists
print(run_tasks(faiss_search, [(i,) for i in range(4)], Parallelism(jobs=2), progress=False))
"""


def faiss_search(seed: int) -> int:
    import faiss
    import numpy as np

    rng = np.random.default_rng(seed)
    index = faiss.IndexFlatIP(64)
    index.add(rng.random((20000, 64), dtype=np.float32))
    _, ids = index.search(rng.random((64, 64), dtype=np.float32), 1)
    return int(ids.shape[0])


def test_forked_runs_search_faiss_after_the_parent_did() -> None:
    """The predictor's retrieval history searches faiss in every run of a sweep; a process forked
    after the parent searched once hung in its first search (GNU OpenMP's pool does not survive
    a fork). Run in a child interpreter so that a hang fails the test instead of stalling it."""
    pytest.importorskip("faiss")
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    child = subprocess.Popen(
        [sys.executable, "-c", _FAISS_AFTER_FORK],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its pool's processes go with it when it hangs
    )
    try:
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail("a forked sweep process hung in faiss's search")
    assert child.returncode == 0, err
    assert out.strip() == "[64, 64, 64, 64]"
