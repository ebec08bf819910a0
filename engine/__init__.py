"""psd-engine: one decoding loop for diffusion language models (docs/algorithms.md §3).

Low-level use from another tool:

    from models import load_model
    from engine import DecodeConfig, generate
    model = load_model("path/to/checkpoint", dtype="bfloat16")
    results = generate(model, [[1, 2, 3], [4, 5]], method="confidence", threshold=0.9, cache="dual")
    results[0].token_ids, results[0].calls, results[0].tpf

Text in, text out (engine/text.py; works from any directory, default: the shipped model):

    import engine
    lm = engine.load()                       # or engine.load("path/to/checkpoint", dtype="bfloat16")
    lm.generate(["Question: What is 2 + 3?\nAnswer: "], method="psd", threshold=0.9)   # -> list[str]
"""
import sys
import types

from models import require_torch

require_torch()   # a missing torch: one error line (models/_torch.py)

from .cache import CACHE_MODES
from .config import DecodeConfig
from .errors import DecodingError, InputError
from .graph import DraftGraph
from .loop import Decoder, generate
from .methods import METHODS, Method, register, unregister
from .options import ACCEPTANCE, OPTIONS, Option
from .policies import Confidence, Greedy, LocalLeap, Policy, PolicyState, TopK
from .results import Final, SequenceResult, StepOutput, StreamUpdate, aggregate
from .text import TextModel, generate_text, load



class _Package(types.ModuleType):
    """`import engine.generate` binds the submodule as an attribute of its package, which would
    shadow the function `engine.generate`; the package keeps the function instead. (Kept after
    issue 30 item 9 tried the alternatives: putting the function in sys.modules["engine.generate"]
    loses `from engine.generate import main` and breaks importlib.util.find_spec on it, and
    importing the submodule first makes `python -m engine.generate` print runpy's warning.)"""

    def __setattr__(self, name, value):
        if name == "generate" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["ACCEPTANCE", "CACHE_MODES", "METHODS", "OPTIONS", "Confidence", "DecodeConfig", "Decoder", "DecodingError", "DraftGraph",
           "Final", "Greedy", "InputError", "LocalLeap", "Method", "Option", "Policy", "PolicyState", "SequenceResult",
           "StepOutput", "StreamUpdate", "TextModel", "TopK", "aggregate", "generate", "generate_text", "load", "register", "unregister"]
