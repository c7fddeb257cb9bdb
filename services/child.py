"""The set-up of a child of `sluice serve` (or of a benchmark or test), done in a launcher that
then becomes the child's program (exec, same process id), and the "listening on HOST:PORT" line
every Sluice service prints once it serves:

    start_listening(cmd, ...) -> (Popen, "HOST:PORT")   a service as a child, once it listens
    listening_address(line)   -> "HOST:PORT" | None     the address of a "listening on" line

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
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO

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


# "sluice worker listening on 127.0.0.1:50061 ...": a host name, IPv4 or bracketed IPv6 address
LISTENING = re.compile(r"listening on ([\w.\-\[\]:]+):(\d+)")


def listening_address(line: str | bytes) -> str | None:
    """The address ("HOST:PORT") of a service's "listening on" line; None for any other line."""
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    match = LISTENING.search(text)
    return f"{match.group(1)}:{match.group(2)}" if match else None


def start_listening(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stderr: int | IO[str] | None = subprocess.DEVNULL,
    timeout_s: float = 60.0,
    die_with_us: bool = True,
    cpus: frozenset[int] | None = None,
    niceness: int = 0,
) -> tuple[subprocess.Popen, str]:
    """`cmd` (a service that prints "listening on HOST:PORT" on its stdout) as a child process
    started through this launcher: killed by the kernel when this process dies (`die_with_us`),
    pinned to `cpus`, at `niceness`. Returns the process and its address once it listens; its
    stdout is closed then (services print nothing more there; their logs go to `stderr`).
    RuntimeError, the process ended, when the set-up fails, the child exits or `timeout_s` passes.
    NOTE: the kernel's "parent" is the calling thread: call it from a thread that outlives the
    child (the main thread), or pass die_with_us=False."""
    read_fd, write_fd = os.pipe()
    try:
        launcher = launcher_command(
            cmd, write_fd, parent=os.getpid() if die_with_us else None, cpus=cpus, niceness=niceness
        )
        # NOTE: no preexec_fn (see above): subprocess starts the launcher with vfork and exec
        process = subprocess.Popen(
            launcher, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd, pass_fds=(write_fd,)
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        problem = ready.read().decode(errors="replace")  # end-of-file once the child's program runs
    address, timed_out = (None, False) if problem else _read_address(process, timeout_s)
    if address is None:
        if timed_out:
            process.kill()
        code = process.wait()  # NOTE: at end-of-file the child is exiting (or has exited)
        why = problem or (f"no address within {timeout_s:g} s" if timed_out else f"it exited with code {code}")
        raise RuntimeError(f"{cmd[0]} {' '.join(cmd[1:4])} ... did not start listening: {why}")
    return process, address


def _read_address(process: subprocess.Popen, timeout_s: float) -> tuple[str | None, bool]:
    """The address of the first "listening on" line of `process`'s stdout (then closed), or None
    when its stdout ends first; and whether `timeout_s` passed first."""
    assert process.stdout is not None
    fd, pending = process.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            # NOTE: select + os.read, not readline: a child that never prints must not block us
            if not select.select([fd], [], [], left)[0]:
                return None, True
            chunk = os.read(fd, 4096)
            if not chunk:
                return None, False
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if address := listening_address(line):
                    return address, False
        return None, True
    finally:
        process.stdout.close()


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
