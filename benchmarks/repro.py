"""One command per paper: its headline claim, as two labelled comparisons (see --help).

    python benchmarks/repro.py PAPER [--claim NAME] [--quick] [--seeds 3] [--jobs N] [--ray ADDRESS]

The claims, runs and tables live in sluice_bench/repro/ (the claims as data: claims.py).
"""

from __future__ import annotations

import sys

from sluice_bench.repro import main

if __name__ == "__main__":
    main(sys.argv[1:])
