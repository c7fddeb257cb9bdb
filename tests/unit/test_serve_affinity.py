"""`sluice serve --worker-cpus / --predictor-cpus`: CPU lists parse or fail naming the setting,
the workers' torch threads follow the pinned set, and a child really runs on the CPUs it was
given (the kernel's own answer, os.sched_getaffinity of the child)."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from services.affinity import format_cpus, parse_cpus
from services.serve import (
    ServeConfig,
    add_serve_arguments,
    cmd_serve,
    spawn_process,
    stop_workers,
    threads_per_worker,
    worker_command,
)
from sluice.common.config import config_from

SLEEPER = [sys.executable, "-c", "import time; time.sleep(30)"]

can_pin = hasattr(os, "sched_setaffinity")
ALLOWED = sorted(os.sched_getaffinity(0)) if can_pin else []
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs this process may use")


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, workers=True)
    return parser.parse_args(argv)


def test_no_cpu_list_means_no_pinning() -> None:
    assert parse_cpus(None, "worker_cpus") is None
    assert parse_cpus("  ", "worker_cpus") is None
    cfg = ServeConfig()
    assert (cfg.worker_cpu_set(), cfg.predictor_cpu_set()) == (None, None)


@needs_two_cpus
def test_cpu_lists_parse_singles_ranges_and_commas() -> None:
    a, b = ALLOWED[0], ALLOWED[1]
    assert parse_cpus(str(a), "worker_cpus") == {a}
    assert parse_cpus(f" {a} , {b} ", "worker_cpus") == {a, b}
    assert parse_cpus(a, "worker_cpus") == {a}, "a config file may give one CPU as a number"
    if b == a + 1:
        assert parse_cpus(f"{a}-{b}", "worker_cpus") == {a, b}


def test_the_formatted_list_is_the_shortest_that_parses_back() -> None:
    assert format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert format_cpus(frozenset({3})) == "3"
    allowed = frozenset(ALLOWED)
    if allowed:
        assert parse_cpus(format_cpus(allowed), "predictor_cpus") == allowed


@pytest.mark.skipif(not can_pin, reason="no sched_setaffinity on this OS")
@pytest.mark.parametrize("spec", ["a", "0-", "-1", "1-0", "0,,1", "0-1-2", "0;1"])
def test_a_malformed_cpu_list_names_the_setting(spec: str) -> None:
    with pytest.raises(ValueError, match=r"^predictor_cpus: "):
        parse_cpus(spec, "predictor_cpus")


@pytest.mark.skipif(not can_pin, reason="no sched_setaffinity on this OS")
def test_a_cpu_this_process_may_not_use_names_the_setting_and_the_cpu() -> None:
    missing = max(ALLOWED) + 1
    with pytest.raises(ValueError, match=rf"^worker_cpus: CPU {missing} not available"):
        parse_cpus(f"{ALLOWED[0]},{missing}", "worker_cpus")
    with pytest.raises(ValueError, match=r"^predictor_cpus: "):
        ServeConfig(predictor_cpus=str(missing)).predictor_cpu_set()


def test_an_os_that_cannot_pin_refuses_a_set_list_but_not_an_empty_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    with pytest.raises(ValueError, match=r"^worker_cpus: this OS cannot pin"):
        parse_cpus("0", "worker_cpus")
    assert parse_cpus("", "worker_cpus") is None


@pytest.mark.skipif(not can_pin, reason="no sched_setaffinity on this OS")
def test_sluice_serve_refuses_a_bad_cpu_list_before_starting_anything() -> None:
    with pytest.raises(SystemExit, match=r"error: worker_cpus: "):
        cmd_serve(_serve_args(["--worker-cpus", str(max(ALLOWED) + 1)]))
    with pytest.raises(SystemExit, match=r"error: predictor_cpus: "):
        cmd_serve(_serve_args(["--predictor-cpus", "0-x"]))


def test_the_cpu_lists_come_from_flags_and_the_environment() -> None:
    args = _serve_args(["--worker-cpus", "0-2", "--predictor-cpus", "3"])
    cfg = config_from(ServeConfig, args, environ={})
    assert (cfg.worker_cpus, cfg.predictor_cpus) == ("0-2", "3")
    cfg = config_from(ServeConfig, _serve_args([]), environ={"SLUICE_PREDICTOR_CPUS": "1"})
    assert (cfg.worker_cpus, cfg.predictor_cpus) == (None, "1")


@pytest.mark.skipif(not can_pin, reason="no sched_setaffinity on this OS")
def test_the_workers_torch_threads_share_out_the_pinned_cpus_not_the_machine() -> None:
    one = str(ALLOWED[0])
    # one worker on one pinned CPU: one thread, whatever os.cpu_count() says
    cfg = ServeConfig(workers=1, worker_cpus=one)
    assert threads_per_worker(cfg) == 1
    command = worker_command(cfg, 0)
    assert command[command.index("--threads") + 1] == "1"
    # more workers than pinned CPUs still get a thread each; an explicit count wins
    assert threads_per_worker(ServeConfig(workers=3, worker_cpus=one)) == 1
    assert threads_per_worker(ServeConfig(workers=1, worker_cpus=one, worker_threads=4)) == 4
    everything = format_cpus(set(ALLOWED))
    assert threads_per_worker(ServeConfig(workers=1, worker_cpus=everything)) == len(ALLOWED)


@needs_two_cpus
@pytest.mark.parametrize("which", [0, 1])
async def test_a_child_runs_on_exactly_the_cpus_it_was_given(which: int) -> None:
    cpus = frozenset({ALLOWED[which]})
    child = await spawn_process(SLEEPER, dict(os.environ), -1, cpus=cpus)
    try:
        assert os.sched_getaffinity(child.proc.pid) == cpus
    finally:
        await stop_workers([child])
    assert os.sched_getaffinity(0) == set(ALLOWED), "the parent keeps every CPU it had"


@needs_two_cpus
async def test_pinning_keeps_the_niceness_it_is_given_with() -> None:
    cpus = frozenset({ALLOWED[1]})
    child = await spawn_process(SLEEPER, dict(os.environ), -1, niceness=5, cpus=cpus)
    try:
        pid = child.proc.pid
        assert os.sched_getaffinity(pid) == cpus
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
    finally:
        await stop_workers([child])


@needs_two_cpus
def test_pinning_this_process_moves_threads_already_running_and_keeps_the_start_set() -> None:
    import threading

    from services.affinity import pin_self

    a, b = ALLOWED[0], ALLOWED[1]
    before = os.sched_getaffinity(0)
    started, stop = threading.Event(), threading.Event()
    thread_id: list[int] = []

    def run() -> None:
        thread_id.append(threading.get_native_id())
        started.set()
        stop.wait(10)

    worker = threading.Thread(target=run)
    worker.start()
    started.wait(5)
    try:
        pin_self(frozenset({a}))
        # NOTE: the thread existed before the call: sched_setaffinity(0) alone would leave it on every CPU
        assert os.sched_getaffinity(thread_id[0]) == {a}
        assert os.sched_getaffinity(0) == {a}
        # a worker restarted after the scheduler narrowed itself may still go to the other CPU
        assert parse_cpus(str(b), "worker_cpus") == {b}
    finally:
        stop.set()
        worker.join()
        os.sched_setaffinity(0, before)
    assert os.sched_getaffinity(0) == before


@needs_two_cpus
async def test_a_child_started_after_the_scheduler_pinned_itself_gets_the_start_set_back() -> None:
    from services.affinity import pin_self, start_cpus

    before = os.sched_getaffinity(0)
    pin_self(frozenset({ALLOWED[0]}))
    try:
        # a worker restarted with no CPU set of its own must not inherit the scheduler's one core
        child = await spawn_process(SLEEPER, dict(os.environ), 0)
        try:
            assert os.sched_getaffinity(child.proc.pid) == start_cpus() == frozenset(ALLOWED)
        finally:
            await stop_workers([child])
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.skipif(not can_pin, reason="no sched_setaffinity on this OS")
async def test_a_child_that_cannot_be_set_up_is_an_error_naming_it_and_leaves_no_process() -> None:
    with pytest.raises(RuntimeError, match=r"predictor could not be set up .*Invalid argument"):
        await spawn_process(SLEEPER, dict(os.environ), -1, cpus=frozenset({4095}))
