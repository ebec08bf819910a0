"""psd-engine: one decoding loop for diffusion language models (ALGORITHMS.md §3).

Low-level use from another tool:

    from models import load_model
    from engine import DecodeConfig, generate
    model = load_model("path/to/checkpoint", dtype="bfloat16")
    results = generate(model, [[1, 2, 3], [4, 5]], method="confidence", threshold=0.9, cache="dual")
    results[0].token_ids, results[0].calls, results[0].tpf
"""
from .config import ACCEPTANCE, CACHE_MODES, METHODS, SCORES, DecodeConfig
from .errors import InputError
from .graph import DraftGraph
from .loop import Decoder, SequenceResult, aggregate, generate
from .policies import Confidence, Greedy, LocalLeap, Policy, TopK

__all__ = ["ACCEPTANCE", "CACHE_MODES", "METHODS", "SCORES", "Confidence", "DecodeConfig", "Decoder", "DraftGraph",
           "Greedy", "InputError", "aggregate", "LocalLeap", "Policy", "SequenceResult", "TopK", "generate"]
