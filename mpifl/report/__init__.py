"""Reading results files back: one run's summary (:mod:`.text`), seed statistics over a sweep's runs
(:mod:`.seeds`) and plots (:mod:`.plots`)."""

from mpifl.report.plots import plot
from mpifl.report.seeds import aggregate, group_runs, mean_2se
from mpifl.report.text import logical_totals, report

__all__ = ["aggregate", "group_runs", "logical_totals", "mean_2se", "plot", "report"]
