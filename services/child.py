"""The set-up of a child of `sluice serve`, done in a launcher that then becomes the child's
program (exec, same process id):

    python -m services.child --ready-fd FD [--parent PID] [--cpus 0,2-3] [--niceness N] [--idle] -- CMD ...
        death with the parent (PR_SET_PDEATHSIG, kept across exec), the CPUs it is pinned to, its
        niceness, SCHED_IDLE -> exec CMD; FD (inherited, closed by the exec) tells the parent
        the set-up is done: it reads end-of-file, or the error text when a step failed (exit 126)

NOTE: why not subprocess's preexec_fn: it forks `sluice serve` with its gRPC threads running and
runs Python in the child before exec. gRPC's fork handlers ran in that child ("Other threads
are currently calling into gRPC, skipping fork() handlers") and it died of SIGSEGV before exec
in about one start in three of the gateway, the one child started after the scheduler serves.
Without preexec_fn, subprocess starts the child with vfork and exec: no fork handler runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def launcher_command(
    cmd: Sequence[str],
    ready_fd: int,
    *,
    parent: int | None = None,
    cpus: frozenset[int] | None = None,
    niceness: int = 0,
    idle: bool = False,
) -> list[str]:
    """`cmd` started through this launcher with the given set-up."""
    out = [sys.executable, "-m", "services.child", "--ready-fd", str(ready_fd)]
    if parent is not None:
        out += ["--parent", str(parent)]
    if cpus:
        out += ["--cpus", ",".join(map(str, sorted(cpus)))]
    if niceness:
        out += ["--niceness", str(niceness)]
    if idle:
        out.append("--idle")
    return [*out, "--", *cmd]


def die_with_parent(parent: int) -> None:
    """The kernel SIGKILLs this process when `parent` dies, however it dies (SIGKILL, the OOM
    killer), so no worker or predictor is left holding its port and memory. A parent that
    died before the call is caught by the getppid check. Elsewhere than Linux: nothing
    (stop_workers still ends the children on every orderly exit)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(1)


def set_up(args: argparse.Namespace) -> None:
    if args.parent is not None:
        die_with_parent(args.parent)
    if args.cpus:
        # NOTE: before exec: inherited by every thread the program starts
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.niceness:
        os.nice(args.niceness)
    if args.idle and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.child")
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--parent", type=int)
    p.add_argument("--cpus")
    p.add_argument("--niceness", type=int, default=0)
    p.add_argument("--idle", action="store_true")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        if not cmd:
            raise ValueError("no command to run after --")
        set_up(args)
    except (OSError, ValueError) as exc:
        os.write(args.ready_fd, f"{type(exc).__name__}: {exc}".encode())
        return 126
    os.set_inheritable(args.ready_fd, False)  # closed by the exec: the parent reads end-of-file
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        os.write(args.ready_fd, f"cannot run {cmd[0]}: {exc}".encode())
        return 127


if __name__ == "__main__":
    sys.exit(main())
