"""Debug output: graph-break reports and the per-graph lift dump (what was lifted and why)."""

from kimi_cg.debug.report import clear_reports, report_graph_break, report_skipped_frame, write_lift_report

__all__ = ["clear_reports", "report_graph_break", "report_skipped_frame", "write_lift_report"]
