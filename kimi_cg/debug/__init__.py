"""Debug output: graph-break reports and the per-graph lift dump (what was lifted and why)."""

from kimi_cg.debug.report import report_graph_break, write_lift_report

__all__ = ["report_graph_break", "write_lift_report"]
