"""The HTML report (`report`, `ac -c --html`): one self-contained file drawn from the
analysis library's own results (the auto check, its compare result, the loss-scale history,
the watchpoints, the repair), with its plots as inline SVG."""
from .html import ReportError, WrittenReport, build_report, write_report

__all__ = ["ReportError", "WrittenReport", "build_report", "write_report"]
