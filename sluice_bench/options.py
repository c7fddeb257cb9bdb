"""The command-line options every benchmark shares, and what they parse into.

--json PATH       the results as JSON (simulation runs: DESIGN.md's schema, report.write_json)
--plot PATH       a PNG of the results
--seeds N         seeds first-seed .. first-seed + N - 1 (each a different draw of the workload)
--first-seed S
--jobs N          independent simulations at once, in local processes (default: the CPU count)
--ray ADDRESS     run them as tasks on that Ray cluster instead (`auto`, `local` or HOST:PORT;
                  default: $RAY_ADDRESS, else local processes)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Parallelism:
    """Where a sweep's independent runs execute: `jobs` local processes (1: in this process), or
    Ray tasks on the cluster at `ray_address`."""

    jobs: int = 1
    ray_address: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Parallelism:
        return cls(jobs=max(1, int(getattr(args, "jobs", 1) or 1)), ray_address=getattr(args, "ray", None) or None)


SERIAL = Parallelism()


def benchmark_parser(doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """A benchmark's parser: its module docstring as the description, line breaks kept."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def add_common_options(
    parser: argparse.ArgumentParser,
    *,
    json: bool = True,
    plot: bool = False,
    seeds: int | None = None,
    parallel: bool = False,
    json_default: str | None = None,
    plot_default: str | None = None,
) -> None:
    """Adds the shared options a script uses: `json`/`plot` paths, `seeds` (the default count;
    None: no seed options) and `parallel` (--jobs and --ray, for scripts that sweep simulations)."""
    if json:
        parser.add_argument("--json", default=json_default, metavar="PATH", help="write the results as JSON here")
    if plot:
        parser.add_argument("--plot", default=plot_default, metavar="PATH", help="write a PNG of the results here")
    if seeds is not None:
        parser.add_argument("--seeds", type=int, default=seeds, help="number of seeds (workload draws)")
        parser.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed .. first-seed + seeds - 1")
    if parallel:
        add_parallel_options(parser)


def add_parallel_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="independent simulations run at once in local processes (1: serially, in this process); "
        "results are identical to the serial run (default: the CPU count)",
    )
    parser.add_argument(
        "--ray",
        default=os.environ.get("RAY_ADDRESS"),
        metavar="ADDRESS",
        help="run the simulations as tasks on this Ray cluster (`auto`, `local`, or HOST:PORT; default: "
        "$RAY_ADDRESS); needs the `ray` extra",
    )


def seed_list(args: argparse.Namespace) -> list[int]:
    """The seeds `--seeds` and `--first-seed` name."""
    return list(range(args.first_seed, args.first_seed + args.seeds))
