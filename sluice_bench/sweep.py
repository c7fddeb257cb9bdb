"""Independent runs of a sweep (grid point x seed), serially, in local processes or as Ray tasks.

    run_sweep(fn, points, seeds, parallelism)  -> [fn(point, seed) for point in points for seed in seeds]
    run_tasks(fn, calls, parallelism)          -> [fn(*args) for args in calls]

The result list has the serial order whatever the executor, and each result is what the serial
run computes: a run depends only on its arguments (its seed included), never on what ran before
it in the same process. `fn` must be a module-level function (it is pickled by reference) and
its results picklable. A progress bar counts finished runs.

Local processes are forked on Linux: the children start with this process's modules and hash
seed, so nothing a run reads differs from the serial run's. A forked child runs OpenMP libraries
the parent has used (faiss: the predictor's retrieval history) on one thread: the parent's
OpenMP worker threads do not exist in the child, and its first parallel region would wait for
them for ever. Ray tasks run in Ray's worker
processes, which import the project's packages (on a cluster, the nodes need this project
installed); a function of a script (a benchmark, a test module) travels by value.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, TypeVar

from tqdm import tqdm

from sluice_bench.options import SERIAL, Parallelism

P = TypeVar("P")
R = TypeVar("R")


def run_sweep(
    fn: Callable[[P, int], R],
    points: Sequence[P],
    seeds: Sequence[int],
    parallelism: Parallelism = SERIAL,
    *,
    desc: str = "",
    progress: bool = True,
) -> list[R]:
    """`fn(point, seed)` for every grid point and seed, point-major (all seeds of the first
    point, then the second's), as the serial loop orders them."""
    calls = [(point, seed) for point in points for seed in seeds]
    return run_tasks(fn, calls, parallelism, desc=desc, progress=progress)


def run_tasks(
    fn: Callable[..., R],
    calls: Sequence[tuple[Any, ...]],
    parallelism: Parallelism = SERIAL,
    *,
    desc: str = "",
    progress: bool = True,
    bar: tqdm | None = None,
) -> list[R]:
    """`fn(*args)` for each of `calls`, results in the order of `calls`. `bar`: a progress bar of
    the caller's to advance (one step per call) instead of a new one."""
    own = bar is None
    if bar is None:
        bar = tqdm(total=len(calls), desc=desc, unit="run", disable=not progress)
    try:
        if parallelism.ray_address:
            return _on_ray(fn, calls, parallelism.ray_address, bar)
        if parallelism.jobs <= 1 or len(calls) <= 1:
            out = []
            for args in calls:
                out.append(fn(*args))
                bar.update(1)
            return out
        return _in_processes(fn, calls, min(parallelism.jobs, len(calls)), bar)
    finally:
        if own:
            bar.close()


def _pool_context() -> multiprocessing.context.BaseContext:
    # NOTE: fork where it exists: the children share this process's hash seed and imports, so a
    # run cannot differ from the serial one by a set's iteration order
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _after_fork() -> None:
    """In each pool process: OpenMP libraries the parent loaded run single-threaded (GNU OpenMP
    does not survive a fork once its thread pool exists; faiss's search then hangs). The runs
    are one per process already, so no parallelism is lost."""
    faiss = sys.modules.get("faiss")
    if faiss is not None:
        faiss.omp_set_num_threads(1)


def _in_processes(fn: Callable[..., R], calls: Sequence[tuple[Any, ...]], jobs: int, bar: tqdm) -> list[R]:
    out: list[Any] = [None] * len(calls)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=_pool_context(), initializer=_after_fork) as pool:
        pending: dict[Future, int] = {pool.submit(fn, *args): i for i, args in enumerate(calls)}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                out[pending.pop(future)] = future.result()
                bar.update(1)
    return out


def _on_ray(fn: Callable[..., R], calls: Sequence[tuple[Any, ...]], address: str, bar: tqdm) -> list[R]:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("--ray needs Ray: pip install -e '.[ray]'") from exc
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, log_to_driver=False)
    module = sys.modules.get(fn.__module__)
    if (
        module is not None
        and fn.__module__ != "__main__"
        and "." not in fn.__module__
        and not hasattr(module, "__path__")
    ):
        # NOTE: a script's module (a benchmark, a test file) is importable only from its own
        # folder, which Ray's workers do not have on their path: its functions travel by value
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(module)
    remote = ray.remote(fn)
    refs = [remote.remote(*args) for args in calls]
    index = {ref: i for i, ref in enumerate(refs)}
    out: list[Any] = [None] * len(calls)
    waiting = list(refs)
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1)
        for ref in done:
            out[index[ref]] = ray.get(ref)
            bar.update(1)
    return out
