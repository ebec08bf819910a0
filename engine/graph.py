"""Draft graphs (docs/algorithms.md §3): nodes are sets of ranks into a step's confidence order.

The root is the empty set. An edge p → k exists whenever S_p ⊂ S_k, so a node may have several
parents (a DAG). Nodes are kept in topological order: by set size, then by the order given.
Stored as JSON: a list of rank lists, e.g. `[[], [0], [0, 1], [1]]`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError, read_json


MAX_NODES = 256      # every node is a row of each verification call; more is never a speedup


class DraftGraph:
    def __init__(self, nodes):
        if not isinstance(nodes, (list, tuple)):
            raise InputError("a draft graph is a list of rank lists")
        if len(nodes) > MAX_NODES:
            raise InputError(f"draft graph has {len(nodes)} nodes; at most {MAX_NODES} are supported "
                             f"(each node is a row of every verification call)")
        sets = []
        for n in nodes:
            if not isinstance(n, (list, tuple, set, frozenset)):
                raise InputError(f"draft graph node {n!r} is not a list of ranks")
            for r in n:
                if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                    raise InputError(f"draft graph node {list(n)!r} holds {r!r}, not a non-negative int")
            s = frozenset(n)
            if len(s) != len(n):
                raise InputError(f"draft graph node {list(n)!r} repeats a rank")
            sets.append(s)
        if frozenset() not in sets:
            raise InputError("draft graph has no root (the empty rank set [])")
        if len(set(sets)) != len(sets):
            dup = next(s for i, s in enumerate(sets) if s in sets[:i])
            raise InputError(f"draft graph repeats the node {sorted(dup)}")
        order = sorted(range(len(sets)), key=lambda i: (len(sets[i]), i))   # stable: ties keep file order
        self.nodes: list[frozenset] = [sets[i] for i in order]
        self.acceptance: list[float] | None = None    # P(node accepted) per step, from calibration
        # parents[k] = indices p with S_p ⊂ S_k (strict subset), in topological order
        self.parents: list[list[int]] = [[p for p in range(k) if self.nodes[p] < self.nodes[k]] for k in range(len(self.nodes))]

    # ---------------------------------------------------------------- constructors
    @classmethod
    def root_only(cls) -> "DraftGraph":
        return cls([[]])

    @classmethod
    def chain(cls, depth: int) -> "DraftGraph":
        if depth < 0:
            raise InputError(f"draft depth must be >= 0, got {depth}")
        return cls([list(range(d)) for d in range(depth + 1)])

    @classmethod
    def load(cls, path: str | Path) -> "DraftGraph":
        path = Path(path)
        raw = read_json(path, "draft graph file")
        rates = raw.get("acceptance") if isinstance(raw, dict) else None
        if isinstance(raw, dict):
            raw = raw.get("nodes")
        if not isinstance(raw, list):
            raise InputError(f"draft graph file {path} is not a list of rank lists")
        graph = cls(raw)
        if rates is not None:
            if not (isinstance(rates, list) and len(rates) == len(raw) and
                    all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a <= 1 for a in rates)):
                raise InputError(f"draft graph file {path}: acceptance must be one rate in [0, 1] per node")
            by_set = {frozenset(n): float(a) for n, a in zip(raw, rates)}
            graph.acceptance = [by_set[s] for s in graph.nodes]
        return graph

    def save(self, path: str | Path, **meta) -> None:
        body = {"nodes": [sorted(s) for s in self.nodes], **meta}
        if self.acceptance is not None and "acceptance" not in meta:
            body["acceptance"] = self.acceptance
        Path(path).write_text(json.dumps(body) + "\n", encoding="utf-8")

    # ---------------------------------------------------------------- views
    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def depth(self) -> int:
        return max(len(s) for s in self.nodes)

    def node_ranks(self, device=None) -> torch.Tensor:
        """[K, D] int64 rank sets padded with -1 (D = max(depth, 1))."""
        out = torch.full((len(self.nodes), max(self.depth, 1)), -1, dtype=torch.int64)
        for k, s in enumerate(self.nodes):
            if s:
                out[k, : len(s)] = torch.tensor(sorted(s))
        return out.to(device)

    def __repr__(self) -> str:
        return f"DraftGraph({[sorted(s) for s in self.nodes]})"


@dataclass
class Plan:
    """The draft nodes one block verifies: a parent-closed sub-graph of the decoder's graph (all of
    it, or what `--draft-budget auto` chose, engine/budget.py), as the loop's tensors."""

    index: torch.Tensor            # [m] node indices into the full graph
    graph: DraftGraph
    node_ranks: torch.Tensor       # [m, D]
    node_size: torch.Tensor        # [m]
    select: object                 # the method's Selection over this sub-graph
    parents: torch.Tensor          # [m, m] float: parents[p, k] = 1 where p is a parent of k


def make_plan(full: DraftGraph, index: list[int], selection, device) -> Plan:
    graph = DraftGraph([sorted(full.nodes[k]) for k in index])
    m = len(index)
    par = torch.zeros(m, m, device=device)
    for k, ps in enumerate(graph.parents):
        par[ps, k] = 1.0
    return Plan(torch.tensor(index, device=device), graph, graph.node_ranks(device),
                torch.tensor([len(s) for s in graph.nodes], device=device), selection(graph), par)
