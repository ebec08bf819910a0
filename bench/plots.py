"""The paper's figures from one `bench.eval` run (matplotlib, Agg backend, PNG files)."""
from __future__ import annotations

import json
from pathlib import Path


def precision_at_k(results, trace, block_len: int, horizons=(1, 2, 3, 4), ks=range(1, 9)) -> dict:
    """For the plain greedy run: the fraction of steps t at which the position committed at step
    t + h lies within the top-K of step t's confidence order σ_t (the paper's Figure 3)."""
    by_step = {}
    for rows, blk, steps, ranks in trace:
        for r, t, rk in zip(rows, steps, ranks):
            by_step[(r, blk, t)] = rk
    committed = {}
    for r, res in enumerate(results):
        for j in range(res.tokens):
            committed[(r, res.commit_block[j], res.commit_step[j])] = j - res.commit_block[j] * block_len
    out = {}
    for h in horizons:
        hits = {k: 0 for k in ks}
        n = 0
        for (r, blk, t), ranks in by_step.items():
            pos = committed.get((r, blk, t + h))
            if pos is None or pos >= len(ranks):
                continue
            n += 1
            for k in ks:
                hits[k] += ranks[pos] < k
        out[h] = {k: hits[k] / n for k in ks} if n else {}
    return out


def contribution_profile(results, block_len: int, bins: int = 8) -> tuple[list[float], list[float]]:
    """Share of committed tokens from stage 1 and from accepted drafts by block progress (the
    fraction of the block already committed when the token was), as in the paper's Figure 4."""
    s1, sp = [0] * bins, [0] * bins
    for res in results:
        for blk in set(res.commit_block):
            idx = [j for j in range(res.tokens) if res.commit_block[j] == blk]
            idx.sort(key=lambda j: (res.commit_call[j], j))
            done = 0
            for call in sorted({res.commit_call[j] for j in idx}):
                group = [j for j in idx if res.commit_call[j] == call]
                b = min(bins - 1, int(bins * done / block_len))
                for j in group:
                    (sp if res.commit_source[j] else s1)[b] += 1
                done += len(group)
    total = max(sum(s1) + sum(sp), 1)
    return [c / total for c in s1], [c / total for c in sp]


def write_plots(out_dir: Path, rows, results: dict, traces: dict, block_len: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    files = [_pareto_figure(plt, out_dir / "pareto.png", rows)]
    data = {"pareto": [{k: r[k] for k in ("method", "accuracy", "tpf")} for r in rows],
            "precision_at_k": {}, "contribution": {}}
    greedy = next((m for m in results if m.startswith("greedy")), None)
    if greedy and traces.get(greedy):
        prec = precision_at_k(results[greedy], traces[greedy], block_len)
        data["precision_at_k"] = {str(h): {str(k): v for k, v in curve.items()} for h, curve in prec.items()}
        files.append(_lookahead_figure(plt, out_dir / "lookahead.png", prec))
    spec = [m for m in results if any(r.commit_source.count(1) for r in results[m])]
    if spec:
        files.append(_contribution_figure(plt, out_dir / "contribution.png", results, spec, block_len,
                                          data["contribution"]))
    files.append(out_dir / "figures.json")             # the numbers behind the figures
    files[-1].write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return files


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pareto_figure(plt, path: Path, rows) -> Path:
    """Accuracy against tokens per forward call, one marker per method."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    markers = "osD^vP*Xh<>p"
    for i, r in enumerate(rows):      # a legend, not inline labels: methods often share a point
        ax.scatter(r["tpf"], 100 * r["accuracy"], s=45, marker=markers[i % len(markers)], alpha=0.8,
                   label=f'{r["method"]}: {100 * r["accuracy"]:.1f}%, TPF {r["tpf"]:.2f}')
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    ax.set_xlabel("tokens per forward call (TPF)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("accuracy vs parallelism")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def _lookahead_figure(plt, path: Path, prec: dict) -> Path:
    """Greedy's precision@K of the step-t confidence order, one curve per lookahead h."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for h, curve in prec.items():
        if curve:
            ax.plot(list(curve), [100 * v for v in curve.values()], marker="o", label=f"step t+{h}")
    ax.set_xlabel("K (top-K of the step-t confidence order)")
    ax.set_ylabel("precision@K (%)")
    ax.set_title("predictability of future decoding positions (greedy)")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def _contribution_figure(plt, path: Path, results: dict, spec: list[str], block_len: int, data: dict) -> Path:
    """Per speculative method, the share of tokens committed by stage 1 and by accepted drafts over
    block progress; the profiles go into `data` by method."""
    fig, axes = plt.subplots(1, len(spec), figsize=(5 * len(spec), 4), squeeze=False)
    for ax, m in zip(axes[0], spec):
        s1, sp = contribution_profile(results[m], block_len)
        data[m] = {"stage1": s1, "speculative": sp}
        x = [(i + 0.5) / len(s1) for i in range(len(s1))]
        ax.plot(x, [100 * v for v in s1], marker="o", label="stage 1 (parallel)")
        ax.plot(x, [100 * v for v in sp], marker="s", label="accepted drafts (speculative)")
        ax.set_xlabel("block progress")
        ax.set_ylabel("share of committed tokens (%)")
        ax.set_title(m, fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return _save(plt, fig, path)
