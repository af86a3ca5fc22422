"""Running a lifted graph: host pass, device program, post views (runner.py); buckets, padding and
CUDA graphs (graphs.py); the host-side gather algebra of per-item data movement (gather_plan.py)."""
