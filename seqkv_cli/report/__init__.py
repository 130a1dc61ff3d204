"""`seqkv report`: measure captures and containers against log2 PP, write files and plots, gate CI.

`build_report(inputs, ReportOptions(...))` collects the rows; `outputs`, `plots` and `gate`
turn them into files and an exit status. docs/REPORT.md describes every field.
"""

from seqkv_cli.report.collect import Report, ReportOptions, build_report
from seqkv_cli.report.gate import Thresholds, check
from seqkv_cli.report.row import Row

__all__ = ["Report", "ReportOptions", "Row", "Thresholds", "build_report", "check"]
