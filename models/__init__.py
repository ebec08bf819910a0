"""Hand-written dLLM model definitions: one transformer, config-driven family differences."""
from ._torch import require_torch

require_torch()   # before anything imports torch: a missing torch is one error line

from .checkpoint import DTYPES, checkpoint_names, init_random, load_model, save_checkpoint
from .config import ModelConfig
from .errors import CheckpointError
from .parallel import ParallelError, TensorParallel, init_tensor_parallel
from .tokenizer import Tokenizer
from .transformer import GEMMS, KVCache, Tokens, Transformer, attention_mask, check_gemm, position_ids

__all__ = ["DTYPES", "GEMMS", "CheckpointError", "KVCache", "ModelConfig", "ParallelError", "TensorParallel", "Tokenizer", "require_torch",
           "Tokens", "Transformer", "attention_mask", "check_gemm", "checkpoint_names", "init_random", "init_tensor_parallel", "load_model",
           "position_ids", "save_checkpoint"]
