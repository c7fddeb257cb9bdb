"""The worker's helper threads on CPUs apart from the ones its steps run on.

A CPU worker's step runs on its event loop's thread (or, for a long step, its engine thread);
gRPC runs threads of its own beside it (its event engine's socket threads, the asyncio poller
that hands completions to the loop, a timer thread), and so do Python's executors and vLLM's
process group. Every step wakes gRPC's threads twice (the next plan read, the answer written):
on the step thread's own core their CPU comes out of the step period. Measured on two cores,
`sluice serve --engine vllm` with the worker placed on core 1: 0.13-0.16 ms (p50) of those
threads' CPU a step, of a 2.1-2.6 ms step (docs/results/vllm_engine.md, "The worker's helper
threads on the scheduler's cores").

`pin_helper_threads` moves every thread of this process to `cpus`, except the ones it is told
to keep (the step threads) and native threads that carry the process's own name, which are the
OpenMP/torch compute threads a step thread started (they must stay beside it). Threads started
later by a moved thread inherit its CPUs; the server calls this again at each Warmup and each
Execute stream, so a thread started meanwhile on the step cores is moved then.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable


def _thread_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def can_pin_threads() -> bool:
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def helper_thread_ids(keep: Iterable[int]) -> list[int]:
    """This process's threads other than `keep` (native ids) and other than native threads named
    as the process (started outside Python: the compute threads of the step threads' OpenMP teams)."""
    kept = set(keep)
    python_threads = {t.native_id for t in threading.enumerate()}
    own_name = _thread_name(os.getpid())
    out = []
    for task in os.listdir("/proc/self/task"):
        tid = int(task)
        if tid in kept:
            continue
        if tid not in python_threads and _thread_name(tid) == own_name:
            continue
        out.append(tid)
    return out


def pin_helper_threads(cpus: frozenset[int] | None, keep: Iterable[int]) -> int:
    """Moves this process's helper threads (all but `keep` and the compute threads) to `cpus`;
    returns how many were moved. Nothing for None or where threads cannot be pinned."""
    if not cpus or not can_pin_threads():
        return 0
    moved = 0
    for tid in helper_thread_ids(keep):
        # NOTE: a thread that ended since the listing has nothing left to pin
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)
            moved += 1
    return moved
