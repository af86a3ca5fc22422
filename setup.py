"""kimi_cg packaging: the backend package plus kernels/ installed as kimi_cg.kernels."""

from setuptools import find_packages, setup

setup(
    name="kimi_cg",
    version="0.1.0",
    description="Compile vision encoders of multimodal LLMs (MoonViT) into CUDA graphs, automatically",
    python_requires=">=3.10",
    packages=find_packages(include=["kimi_cg", "kimi_cg.*"]) + ["kimi_cg.kernels"],
    # kernels/ sits at the top level of the repository but installs as kimi_cg.kernels, so nothing
    # named plain `kernels` (an unrelated PyPI project owns that name) lands in site-packages.
    package_dir={"kimi_cg.kernels": "kernels"},
    # triton: the merge-gather kernels (CUDA) and their PyTorch references live in one module.
    install_requires=["torch>=2.11", "triton>=3.0", "sympy", "safetensors", "tqdm", "numpy"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "triton==3.6.0", "transformers>=5.0"],
        "flash": ["flash-attn"],
    },
    entry_points={"torch_dynamo_backends": ["kimi_cg = kimi_cg.backend:kimi_cg_backend"]},
)
