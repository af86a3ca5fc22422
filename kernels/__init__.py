"""Triton kernels, installed as ``kimi_cg.kernels`` (see setup.py's package_dir)."""
