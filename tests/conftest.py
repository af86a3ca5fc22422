"""Shared fixtures: every test starts with fresh dynamo caches and zeroed kimi_cg counters, in no_grad mode."""


import os

import pytest
import torch

# Without CUDA, Triton kernels run on CPU tensors through Triton's interpreter, which @triton.jit
# chooses when it decorates a kernel: TRITON_INTERPRET must be set before the kernel modules are first
# imported. Set here, before any test module runs, because importing transformers can import them
# first: its hub-kernels check imports a top-level module named `kernels`, which in a checkout is this
# repository's kernels/ (installed, it is kimi_cg.kernels and nothing named `kernels` exists).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kimi_cg  # noqa: E402

# The program cache (NOTE [program cache]) is on by default under Inductor's cache directory: tests
# compile from scratch and write nothing there; the program cache's own tests name a directory.
os.environ["KIMI_CG_PROGRAM_CACHE"] = "0"

# kimi_cg.testing's fixture (kimi_cg_fuzz), as a user enables it.
pytest_plugins = ["kimi_cg.testing.pytest_plugin"]


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    kimi_cg.reset()
    # Tests run as serving runs, without gradients: a call in grad mode with weights that require
    # grad runs the captured graph (kimi_cg is inference-only), which would test the fallback
    # instead of the lifted program. Tests of grad mode enable it themselves.
    with torch.no_grad():
        yield
    torch._dynamo.reset()
