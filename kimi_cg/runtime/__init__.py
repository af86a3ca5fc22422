"""Running a lifted graph: host pass, device program, post views (runner.py)."""
