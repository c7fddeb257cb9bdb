"""Automatic CPU placement for `sluice serve`: which cores each worker's model runner gets, and
which the scheduler side (this process, the predictor, the gateway) keeps, when no CPU list was
given.

Why: a worker's model runner is one busy loop of compute threads. Unpinned on a machine with
few cores, the scheduler process (planning each step, streaming its tokens) and the client take
the runner's core in turns; measured on two cores, `sluice serve --engine vllm` made 0.82x vLLM
alone's offline output tokens/s unpinned and 1.01x placed by this rule, our torch engine 1.12x
its unpinned rate (docs/results/vllm_engine.md, "The product default"). The rule is pure (cores,
workers, engine -> sets) so it is tested without a machine of each shape; services/serve.py
applies it.

The rule, for the engines in AUTO_PIN_ENGINES on a CPU device:
- each worker needs `threads` cores (its torch threads; 1 when the thread count is left to the
  CPU count) and the scheduler side at least 1: with fewer cores nothing is placed (the note
  says why, once);
- the scheduler side gets one core per process it runs (the scheduler, the predictor, the
  gateway child), as far as the workers' minimum leaves, on the lowest-numbered cores;
- the workers share the highest-numbered cores out evenly, contiguous blocks in worker order
  (`threads` each when the thread count is explicit); what does not divide evenly goes to the
  scheduler side.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.affinity import format_cpus

# NOTE: the engines whose step loop was measured to gain from a core of its own
# (docs/results/vllm_engine.md, "The product default"); echo computes nothing.
AUTO_PIN_ENGINES = frozenset({"vllm", "torch"})


@dataclass(frozen=True)
class Placement:
    """Each worker's CPUs (by worker id) and the scheduler side's; no workers: not placed, and
    `note` (when not empty) says why."""

    workers: tuple[frozenset[int], ...] = ()
    others: frozenset[int] = frozenset()
    note: str = ""

    @property
    def placed(self) -> bool:
        return bool(self.workers)

    def describe(self) -> str:
        workers = "; ".join(f"worker {i} on {format_cpus(c)}" for i, c in enumerate(self.workers))
        return f"{workers}; the scheduler, predictor and gateway on {format_cpus(self.others)}"


def auto_placement(
    cpus: Iterable[int],
    workers: int,
    engine: str,
    device: str = "cpu",
    threads: int = 0,
    helpers: int = 1,
) -> Placement:
    """Where `workers` workers of `engine` on `device` and the scheduler side go among `cpus`
    (the CPUs this process may use). `threads`: each worker's torch threads when given (0: as
    many as its cores); `helpers`: the processes of the scheduler side (the scheduler, plus the
    predictor and the gateway child when started). Not placed for another engine, a GPU device,
    or too few cores (with a note)."""
    if engine not in AUTO_PIN_ENGINES or not device.startswith("cpu") or workers < 1:
        return Placement()
    cores = sorted(set(cpus))
    each = max(1, threads)
    if len(cores) < workers * each + 1:
        need = f"{workers} worker{'s' if workers > 1 else ''} of {each} core{'s' if each > 1 else ''} each"
        return Placement(
            note=f"no automatic CPU placement: {len(cores)} CPUs for {need} and the scheduler; "
            "every process shares every CPU (--worker-cpus and --scheduler-cpus place them by hand)"
        )
    reserve = max(1, min(helpers, len(cores) - workers * each))
    each = threads or (len(cores) - reserve) // workers
    first = len(cores) - workers * each
    blocks = tuple(frozenset(cores[first + i * each : first + (i + 1) * each]) for i in range(workers))
    return Placement(blocks, frozenset(cores[:first]))
