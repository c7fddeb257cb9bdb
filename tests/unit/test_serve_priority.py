"""`sluice serve` starts the predictor where it cannot take a core from the serving path: at idle
CPU priority (SCHED_IDLE) as well as its niceness, or at its niceness alone when told."""

from __future__ import annotations

import os
import sys

import pytest

from services.serve import spawn_process, stop_workers

SLEEPER = [sys.executable, "-c", "import time; time.sleep(30)"]

needs_sched_idle = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this OS")


@needs_sched_idle
@pytest.mark.parametrize("idle", [True, False])
async def test_the_predictor_child_runs_at_the_priority_it_was_given(idle: bool) -> None:
    child = await spawn_process(SLEEPER, dict(os.environ), -1, niceness=7, idle=idle)
    try:
        pid = child.proc.pid
        policy = os.sched_getscheduler(pid)
        assert (policy == os.SCHED_IDLE) is idle
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + 7
    finally:
        await stop_workers([child])
