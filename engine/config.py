"""Decoding options: one dataclass of orthogonal settings, validated once before decoding."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError
from .graph import DraftGraph
from .policies import Confidence, CrossBlock, Greedy, LocalLeap, Policy, TopK

POLICIES = ("greedy", "topk", "confidence", "localleap")
METHODS = POLICIES + ("spiffy", "psd", "lopa", "ete", "fdm")
CACHE_MODES = ("none", "prefix", "dual")
SCORES = ("prob", "margin", "entropy")
CONF_DTYPES = ("float32", "float64")
ACCEPTANCE = ("policy", "exact")
# how the kept draft is chosen: hierarchical acceptance (PSD/Spiffy), LoPA's best mean
# confidence, or FDM's trust in the drafting step's own confidence (reconstruction, docs/methods.md)
SELECTIONS = ("hierarchical", "best_score", "draft_conf")


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
    graph: DraftGraph | None = None   # spiffy/psd: draft graph (default: the chain of `depth`)
    depth: int = 3                    # spiffy/psd: chain depth when no graph is given
    policy_name: str = "confidence"   # psd: the spatial policy under the speculation
    acceptance: str = "policy"        # psd: the policy's own criterion, or "exact" (lossless)
    k: int = 3                        # lopa: branches; ete: blocks in the window; fdm: future steps

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
        if self.policy_name not in POLICIES:
            raise InputError(f"unknown policy {self.policy_name!r}; expected one of {', '.join(POLICIES)}")
        if self.depth < 0:
            raise InputError(f"draft depth must be >= 0, got {self.depth}")
        if self.k < 1:
            raise InputError(f"k must be >= 1, got {self.k}")
        if self.graph is not None and self.method not in ("spiffy", "psd"):
            raise InputError(f"a draft graph applies to spiffy and psd, not to {self.method}")
        if self.spatial == "topk":
            blocks = self.gen_length // self.block_length
            steps = self.gen_length if self.steps is None else self.steps
            if steps < blocks or steps % blocks:
                raise InputError(f"steps {steps} must be a positive multiple of the number of blocks {blocks}")
        return self

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def spatial(self) -> str:
        """The stage-1 policy this method runs."""
        return {"spiffy": "greedy", "psd": self.policy_name, "lopa": "confidence", "ete": "confidence",
                "fdm": "greedy"}.get(self.method, self.method)

    def policy(self) -> Policy:
        name = self.spatial
        if name == "greedy":
            return Greedy()
        if name == "topk":
            steps = self.gen_length if self.steps is None else self.steps
            return TopK(self.block_length, steps // self.num_blocks)
        tau = self.threshold
        if self.method == "ete":
            return CrossBlock(0.9 if tau is None else tau, self.block_length)
        if name == "confidence":
            return Confidence(0.9 if tau is None else tau)
        return LocalLeap(self.kappa, 0.75 if tau is None else tau, self.window)

    def draft_graph(self) -> DraftGraph:
        if self.method in ("spiffy", "psd"):
            return self.graph if self.graph is not None else DraftGraph.chain(self.depth)
        if self.method == "lopa":      # branch j adds the j-th next most confident position
            return DraftGraph([[]] + [[j] for j in range(self.k - 1)])
        if self.method == "fdm":       # the current state and k future greedy states
            return DraftGraph.chain(self.k)
        return DraftGraph.root_only()

    @property
    def selection(self) -> str:
        return {"lopa": "best_score", "fdm": "draft_conf"}.get(self.method, "hierarchical")

    @property
    def exact(self) -> bool:
        return self.method == "spiffy" or (self.method == "psd" and self.acceptance == "exact")

    @property
    def window_blocks(self) -> int:
        """Blocks whose masked positions are eligible in one step (ETE's cross-block window)."""
        return self.k if self.method == "ete" else 1

    def describe(self) -> str:
        pol = self.policy().describe()
        if self.method in ("spiffy", "psd"):
            g = self.draft_graph()
            shape = f"d={self.depth}" if self.graph is None else f"graph={len(g)} nodes,d={g.depth}"
            return f"{self.method}({pol},{shape},{'exact' if self.exact else 'policy'})"
        if self.method in ("lopa", "ete", "fdm"):
            return f"{self.method}(k={self.k},{pol})"
        return pol
