"""CPU sets for the processes `sluice serve` starts: "0", "0-3", "0,2-3" -> the CPUs a child is
pinned to (Linux sched_setaffinity), so the length predictor can have cores the workers never
use, as it has when it runs as its own container."""

from __future__ import annotations

import contextlib
import os


def can_pin() -> bool:
    """Whether this OS can pin a process to CPUs (Linux can; macOS has no sched_setaffinity)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def parse_cpus(spec: str | int | None, name: str) -> frozenset[int] | None:
    """The CPUs of a list like "0,2-3"; None for no pinning (None or blank). ValueError naming
    `name` for a malformed list, a CPU this process may not use, or an OS that cannot pin (a set
    option is never ignored: a measurement would silently run unpinned)."""
    # NOTE: str() because a JSON or TOML config file may give a single CPU as a number
    text = "" if spec is None else str(spec).strip()
    if not text:
        return None
    if not can_pin():
        raise ValueError(f"{name}: this OS cannot pin a process to CPUs (no os.sched_setaffinity)")
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(f"{name}: not a CPU list like 0,2-3: {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"{name}: not a CPU range: {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    allowed = start_cpus()
    if not cpus <= allowed:
        raise ValueError(
            f"{name}: CPU {format_cpus(cpus - allowed)} not available to this process "
            f"(it may use {format_cpus(allowed)})"
        )
    return frozenset(cpus)


_START_CPUS: frozenset[int] | None = None
_PINNED_SELF = False


def start_cpus() -> frozenset[int]:
    """The CPUs this process could use when it first asked (its cgroup or `taskset` set).
    NOTE: remembered, because `sluice serve --scheduler-cpus` narrows this process's own set
    after starting the children, and a worker restarted later may still be pinned to the rest."""
    global _START_CPUS
    if _START_CPUS is None:
        _START_CPUS = frozenset(os.sched_getaffinity(0))
    return _START_CPUS


def pin_self(cpus: frozenset[int] | None) -> None:
    """Pins every thread of this process (and so the threads they start later) to `cpus`;
    nothing for None.
    NOTE: Linux's sched_setaffinity(0) moves only the calling thread; gRPC and the event loop's
    executor may already run threads of their own, so each task of /proc/self/task is moved."""
    global _PINNED_SELF
    if not cpus:
        return
    start_cpus()
    _PINNED_SELF = True
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tasks:
        # NOTE: a thread that ended since the listing has nothing left to pin
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def child_cpus(cpus: frozenset[int] | None) -> frozenset[int] | None:
    """The CPUs to pin a new child to: its own set, else (once this process has narrowed itself
    with pin_self) the set this process started with.
    NOTE: a child inherits its parent's affinity; without this, a worker restarted after
    `--scheduler-cpus` took effect would be confined to the scheduler's cores."""
    if cpus:
        return cpus
    return start_cpus() if _PINNED_SELF else None


def format_cpus(cpus: set[int] | frozenset[int]) -> str:
    """The shortest list that parse_cpus reads back: {0, 1, 2, 5} -> "0-2,5"."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and cpu == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)
