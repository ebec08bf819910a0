"""Decoding options: one dataclass of orthogonal settings, validated once before decoding."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError
from .graph import DraftGraph
from .policies import Confidence, Greedy, LocalLeap, Policy, TopK

METHODS = ("greedy", "topk", "confidence", "localleap")
CACHE_MODES = ("none", "prefix", "dual")
SCORES = ("prob", "margin", "entropy")
CONF_DTYPES = ("float32", "float64")
ACCEPTANCE = ("policy", "exact")


@dataclass
class DecodeConfig:
    method: str = "greedy"
    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None          # topk: total steps (default gen_length, one token per step)
    threshold: float | None = None    # confidence: tau (0.9); localleap: tau (0.75)
    kappa: float = 0.9                # localleap anchor threshold
    window: int = 4                   # localleap W
    cache: str = "none"
    score: str = "prob"
    temperature: float = 0.0
    seed: int = 0
    conf_dtype: str = "float32"       # float64 for parity with references that use it
    graph: DraftGraph | None = None   # None = root only (the plain policy)
    acceptance: str = "policy"        # draft acceptance: the policy's own criterion, or "exact" (lossless)

    def validate(self) -> "DecodeConfig":
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; expected one of {', '.join(METHODS)}")
        if self.cache not in CACHE_MODES:
            raise InputError(f"unknown cache mode {self.cache!r}; expected one of {', '.join(CACHE_MODES)}")
        if self.score not in SCORES:
            raise InputError(f"unknown confidence score {self.score!r}; expected one of {', '.join(SCORES)}")
        if self.conf_dtype not in CONF_DTYPES:
            raise InputError(f"unknown confidence dtype {self.conf_dtype!r}; expected one of {', '.join(CONF_DTYPES)}")
        if self.acceptance not in ACCEPTANCE:
            raise InputError(f"unknown acceptance mode {self.acceptance!r}; expected one of {', '.join(ACCEPTANCE)}")
        if self.block_length < 1:
            raise InputError(f"block length must be >= 1, got {self.block_length}")
        if self.gen_length < 1:
            raise InputError(f"gen length must be >= 1, got {self.gen_length}")
        if self.gen_length % self.block_length:
            raise InputError(f"gen length {self.gen_length} is not a multiple of the block length {self.block_length}")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise InputError(f"threshold {self.threshold} is outside (0, 1]")
        if not 0.0 < self.kappa <= 1.0:
            raise InputError(f"kappa {self.kappa} is outside (0, 1]")
        if self.window < 0:
            raise InputError(f"window must be >= 0, got {self.window}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.method == "topk":
            blocks = self.gen_length // self.block_length
            steps = self.gen_length if self.steps is None else self.steps
            if steps < blocks or steps % blocks:
                raise InputError(f"steps {steps} must be a positive multiple of the number of blocks {blocks}")
        return self

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    def policy(self) -> Policy:
        if self.method == "greedy":
            return Greedy()
        if self.method == "topk":
            steps = self.gen_length if self.steps is None else self.steps
            return TopK(self.block_length, steps // self.num_blocks)
        if self.method == "confidence":
            return Confidence(0.9 if self.threshold is None else self.threshold)
        return LocalLeap(self.kappa, 0.75 if self.threshold is None else self.threshold, self.window)

    def draft_graph(self) -> DraftGraph:
        return self.graph if self.graph is not None else DraftGraph.root_only()
