"""`sluice serve`'s automatic CPU placement: the rule (services/placement.py: cores x workers x
engine -> each worker's CPUs and the scheduler side's) on machines of every shape, and how
`sluice serve` applies it (explicit CPU lists and --no-auto-pin win; the workers' torch threads
follow their own cores; a restarted worker gets the same cores back)."""

from __future__ import annotations

import argparse
import itertools
import os

import pytest

import services.serve as serve
from services.placement import AUTO_PIN_ENGINES, Placement, auto_placement
from services.serve import ServeConfig, add_serve_arguments, threads_per_worker, worker_command
from sluice.common.config import config_from


def cpus(spec: str) -> frozenset[int]:
    """The set of a CPU list like 0-3,6: the tests read like the CPU lists they stand for."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


# ---------------------------------------------------------------- the rule


def test_two_cores_one_vllm_worker_its_model_runner_on_the_last_core_the_scheduler_on_the_first() -> None:
    # the measured case: the worker's runner alone on core 1, the scheduler (and predictor) on core 0
    for helpers in (1, 2, 3):
        placement = auto_placement(cpus("0-1"), workers=1, engine="vllm", helpers=helpers)
        assert placement == Placement((cpus("1"),), cpus("0"))


def test_too_few_cores_places_nothing_and_says_why() -> None:
    one = auto_placement(cpus("0"), workers=1, engine="vllm")
    assert not one.placed and one.others == frozenset()
    assert "1 CPUs for 1 worker of 1 core each and the scheduler" in one.note
    two_workers = auto_placement(cpus("0-1"), workers=2, engine="vllm")
    assert not two_workers.placed and "2 CPUs for 2 workers" in two_workers.note
    # an explicit thread count is the cores each worker needs
    threads = auto_placement(cpus("0-7"), workers=2, engine="vllm", threads=4)
    assert not threads.placed and "2 workers of 4 cores each" in threads.note


def test_three_cores_two_workers_each_on_a_core_of_its_own() -> None:
    placement = auto_placement(cpus("0-2"), workers=2, engine="vllm", helpers=2)
    assert placement.workers == (cpus("1"), cpus("2")) and placement.others == cpus("0")


def test_the_scheduler_side_gets_a_core_per_process_the_workers_share_the_rest_evenly() -> None:
    # scheduler, predictor and gateway: three cores; one worker: the other 13
    assert auto_placement(cpus("0-15"), 1, "vllm", helpers=3) == Placement((cpus("3-15"),), cpus("0-2"))
    # three workers share 15 cores: 5 each, in worker order from the top
    three = auto_placement(cpus("0-15"), 3, "vllm", helpers=1)
    assert three == Placement((cpus("1-5"), cpus("6-10"), cpus("11-15")), cpus("0"))
    # what does not divide evenly goes to the scheduler side, not to one worker
    assert auto_placement(cpus("0-16"), 3, "vllm", helpers=1).others == cpus("0-1")


def test_an_explicit_thread_count_gives_each_worker_that_many_cores_and_the_rest_to_the_scheduler() -> None:
    placement = auto_placement(cpus("0-7"), workers=2, engine="vllm", threads=2)
    assert placement == Placement((cpus("4-5"), cpus("6-7")), cpus("0-3"))
    assert auto_placement(cpus("0-1"), 1, "vllm", threads=1) == Placement((cpus("1"),), cpus("0"))


def test_only_the_cpus_this_process_may_use_are_placed() -> None:
    # a cgroup or `taskset` set with holes: cores outside it are never handed out
    placement = auto_placement(cpus("2-3,6-7"), workers=1, engine="vllm", helpers=1)
    assert placement == Placement((cpus("3,6-7"),), cpus("2"))


@pytest.mark.parametrize(("engine", "device"), [("echo", "cpu"), ("vllm", "cuda"), ("torch", "cuda:1")])
def test_engines_and_devices_outside_the_rule_are_left_alone_without_a_note(engine: str, device: str) -> None:
    assert auto_placement(cpus("0-15"), workers=1, engine=engine, device=device) == Placement()


def test_every_placement_splits_the_cpus_into_disjoint_sets_of_equal_workers() -> None:
    for n, workers, threads, helpers in itertools.product(range(1, 20), range(1, 6), (0, 1, 2, 3), (1, 2, 3)):
        available = frozenset(range(100, 100 + n))
        placement = auto_placement(available, workers, "vllm", threads=threads, helpers=helpers)
        shape = (n, workers, threads, helpers)
        if n < workers * max(1, threads) + 1:
            assert not placement.placed and placement.note, shape
            continue
        assert len(placement.workers) == workers and placement.others, shape
        every = [placement.others, *placement.workers]
        assert sum(map(len, every)) == len(frozenset().union(*every)), f"overlapping sets: {shape}"
        assert frozenset().union(*every) == available, shape
        assert {len(w) for w in placement.workers} == {threads or len(placement.workers[0])}, shape
        assert min(placement.workers[0]) > max(placement.others), f"the workers take the highest cores: {shape}"


def test_the_rule_covers_both_model_engines_and_not_the_echo_engine() -> None:
    assert {"vllm", "torch"} <= AUTO_PIN_ENGINES and "echo" not in AUTO_PIN_ENGINES
    for engine in ("vllm", "torch"):
        assert auto_placement(cpus("0-1"), 1, engine) == Placement((cpus("1"),), cpus("0"))


# ---------------------------------------------------------------- as `sluice serve` applies it


@pytest.fixture
def four_cpus(monkeypatch: pytest.MonkeyPatch) -> frozenset[int]:
    """`sluice serve` started on CPUs 0-3 (its start set is what the placement divides)."""
    monkeypatch.setattr(serve, "start_cpus", lambda: cpus("0-3"))
    monkeypatch.setattr(serve, "can_pin", lambda: True)
    return cpus("0-3")


def test_serve_places_vllm_workers_and_their_threads_follow_their_own_cores(four_cpus: frozenset[int]) -> None:
    cfg = ServeConfig(engine="vllm", workers=1, start_predictor=False)
    assert cfg.placement() == Placement((cpus("1-3"),), cpus("0"))
    assert cfg.worker_cpu_set_of(0) == cpus("1-3")
    assert cfg.others_cpu_set(None) == cpus("0"), "the predictor, gateway and scheduler share the rest"
    command = worker_command(cfg, 0)
    assert command[command.index("--threads") + 1] == "3"
    # two workers on the 3 cores left by the scheduler: one each, one thread each
    two = ServeConfig(engine="vllm", workers=2, start_predictor=True)
    assert [two.worker_cpu_set_of(w) for w in (0, 1)] == [cpus("2"), cpus("3")]
    assert [threads_per_worker(two, w) for w in (0, 1)] == [1, 1]
    assert two.others_cpu_set(None) == cpus("0-1")


def test_the_placement_stays_put_when_serve_learns_its_predictors_address(four_cpus: frozenset[int]) -> None:
    # serve() sets `predictor` to the started child's address; a worker restarted later must
    # get the cores it had
    cfg = ServeConfig(engine="vllm", workers=1)
    before = cfg.placement()
    cfg.predictor = "127.0.0.1:5000"
    assert cfg.placement() == before


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no sched_getaffinity on this OS")
@pytest.mark.parametrize("given", ["worker_cpus", "scheduler_cpus", "predictor_cpus", "auto_pin"])
def test_explicit_cpu_lists_and_no_auto_pin_win(four_cpus: frozenset[int], given: str) -> None:
    # NOTE: a CPU this process really has: the lists are checked against the machine
    value = False if given == "auto_pin" else str(min(os.sched_getaffinity(0)))
    cfg = ServeConfig(engine="vllm", workers=1, **{given: value})  # type: ignore[arg-type]
    assert not cfg.placement().placed
    assert cfg.worker_cpu_set_of(0) == cfg.worker_cpu_set()
    assert cfg.others_cpu_set(cfg.scheduler_cpu_set()) == cfg.scheduler_cpu_set()


def test_the_default_torch_engine_is_placed_and_the_echo_engine_left_alone(four_cpus: frozenset[int]) -> None:
    assert ServeConfig(workers=1).worker_cpu_set_of(0) == cpus("2-3"), "predictor started: 2 cores for the rest"
    assert threads_per_worker(ServeConfig(workers=1)) == 2
    echo = ServeConfig(engine="echo", workers=1)
    assert not echo.placement().placed and echo.worker_cpu_set_of(0) is None
    assert echo.others_cpu_set(None) is None


def test_auto_pin_comes_from_the_flag_and_the_environment() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, workers=True)
    assert config_from(ServeConfig, parser.parse_args([]), environ={}).auto_pin is True
    assert config_from(ServeConfig, parser.parse_args(["--no-auto-pin"]), environ={}).auto_pin is False
    assert config_from(ServeConfig, parser.parse_args([]), environ={"SLUICE_AUTO_PIN": "false"}).auto_pin is False
