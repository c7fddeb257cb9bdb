"""The paper reproductions: claims as data (`claims`), their runs and capacities (`runs`), their
tables and plots (`tables`) and the command (`cli`, run as `python benchmarks/repro.py`)."""

from sluice_bench.repro.claims import (
    EQUAL_ENGINE,
    PAPERS,
    PUBLISHED,
    Claim,
    Comparison,
    Rule,
    System,
    with_length_source,
)
from sluice_bench.repro.cli import main
from sluice_bench.repro.combine import combine, combine_capacities, complete_rates, merge_results
from sluice_bench.repro.runs import (
    HELD_OUT,
    Setup,
    capacity,
    idle_bound,
    run_claim,
    run_one,
    sample_trace,
    scls_cause,
    steady_metrics,
    truncate,
    workload,
)
from sluice_bench.repro.tables import claim_tables, plot

__all__ = [
    "EQUAL_ENGINE",
    "HELD_OUT",
    "PAPERS",
    "PUBLISHED",
    "Claim",
    "Comparison",
    "Rule",
    "Setup",
    "System",
    "capacity",
    "claim_tables",
    "combine",
    "combine_capacities",
    "complete_rates",
    "idle_bound",
    "main",
    "merge_results",
    "plot",
    "run_claim",
    "run_one",
    "sample_trace",
    "scls_cause",
    "steady_metrics",
    "truncate",
    "with_length_source",
    "workload",
]
