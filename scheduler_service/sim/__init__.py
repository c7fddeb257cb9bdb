"""The trace-driven simulator: workloads, SLO profiles and the virtual-clock executor."""
