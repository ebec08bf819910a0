"""The sampler: what a model call's logits [R, W, V] become, the token and the confidence of every
position (docs/loop.md, "Sampling").

One `Sampler` is built per `Decoder` from its `DecodeConfig` and owns everything between the logits
and `psd_kernels.top1`: the stop tokens barred by `--ignore-eos` / `--min-tokens`, the confidence
dtype, the sampling generator (seeded by `--seed`), the Gumbel noise at `--temperature` > 0 with
`--top-k` / `--top-p`, and the `--top-logprobs` alternatives. The loop calls `predict` once per model
call and never touches a generator or a logit itself.

At temperature 0 nothing is drawn and no generator exists: the token is the argmax. At temperature
T > 0 the token is the Gumbel-max sample argmax(logits / T + g), g = -log(-log u) from a float64
uniform draw u of the logits' shape (LLaDA's rule); the confidence stays the untempered
probability of the sampled token. With `--sampler batch` (the default, LLaDA's own draw) one
generator serves the whole batch, so a sampled result depends on the batch's composition and on
the order of the calls (docs/loop.md says what a cheaper, per-position stream would change). With
`--sampler row` every sequence has its own generator (`generators`: seeded with its own seed, the
batch's rows `seed + i`, a server's request its request's seed), carried with the sequence as rows
join and leave, and each canvas of a call draws from its sequence's: a sampled result is then the
same whatever else is in its batch, and a sequence alone draws exactly what `--sampler batch` draws.
"""
from __future__ import annotations

import torch

import psd_kernels

NEG_INF = float("-inf")


class Sampler:
    """Logits to (token, confidence, alternatives) under one decoding configuration; holds the
    sampling generator, so the draws continue from batch to batch of the same decoder."""

    def __init__(self, dc, mc, device: torch.device):
        """`dc`: the (validated) DecodeConfig; `mc`: the model's ModelConfig."""
        self.mask_id = mc.mask_token_id
        self.stop_ids = torch.tensor(mc.stop_token_ids, device=device)
        self.score, self.conf_dtype, self.top_logprobs = dc.confidence_score, dc.conf_dtype, dc.top_logprobs
        self.temperature, self.top_k, self.top_p = dc.temperature, dc.top_k, dc.top_p
        self.ignore_eos = bool(dc.ignore_eos)
        self.min_tokens = 0 if self.ignore_eos else min(dc.min_tokens, mc.max_length)
        self.per_row = self.temperature > 0 and dc.sampler == "row"
        self.device = device
        # the batch's one generator (--sampler batch); --sampler row draws from the rows' own (`generators`)
        self.gen = torch.Generator(device=device).manual_seed(dc.seed) if self.temperature > 0 and not self.per_row \
            else None

    def generators(self, seeds) -> list | None:
        """One generator per sequence, seeded with its seed (`--sampler row` at temperature > 0), else None."""
        if not self.per_row:
            return None
        return [torch.Generator(device=self.device).manual_seed(int(s) % 2 ** 64) for s in seeds]

    @staticmethod
    def rows_of(gens: list | None, rows, real: int | None = None) -> list | None:
        """The generators of rows `rows` (indices, a tensor or a list) of `gens`; None stays None
        (`--sampler batch`, or temperature 0). One host read of `rows`. `real`: only the first
        `real` rows draw, the others (--static-rows' filler canvases of rows done with the block)
        get None, so no sequence's generator draws for them."""
        if gens is None:
            return None
        out = [gens[i] for i in torch.as_tensor(rows).reshape(-1).tolist()]
        return out if real is None else out[:real] + [None] * (len(out) - real)

    def predict(self, logits: torch.Tensor, gen_start: torch.Tensor | None = None, lo: int = 0, gens=None,
                valid: torch.Tensor | None = None):
        """Top-1 token and confidence [R, W] from the logits [R, W, V] of the window starting at
        column `lo`, for rows that start generating at `gen_start` [R] (needed with --min-tokens),
        and with --top-logprobs k the k most likely (id, probability) [R, W, k, 2] (else None).
        Draws noise only at temperature > 0: from the generator, or with `--sampler row` from `gens`,
        the generator of each row's sequence (R of them, in row order), over the window's columns
        each row has (`valid` [R, N], its canvas's valid columns: a window wider than a shorter
        row's end, ETE's in a batch of mixed lengths, draws what the row alone draws)."""
        if self.conf_dtype == "float64":
            logits = logits.double()
        logits = self._bar_stops(logits, None if gen_start is None else self.no_stop(gen_start, lo, logits.shape[1]))
        widths = None
        if self.per_row and valid is not None:        # columns lo... each row has: to its last valid one
            ends = valid.shape[1] - valid.flip(1).to(torch.uint8).argmax(1)
            widths = (ends - lo).clamp(0, logits.shape[1]).tolist()
        noise = self.noise(logits, gens, widths) if self.temperature > 0 else None
        pred, conf = psd_kernels.top1(logits, self.mask_id, score=self.score, temperature=self.temperature,
                                      noise=noise)
        return pred, conf, self.top(logits) if self.top_logprobs else None

    def no_stop(self, gen_start: torch.Tensor, lo: int, width: int) -> torch.Tensor | None:
        """[R, width] True at the columns `lo ...` where a row may not predict a stop token: its
        first `min_tokens` generated positions (rows start generating at `gen_start` [R]); None
        when no position is barred."""
        if not self.min_tokens:
            return None
        col = torch.arange(lo, lo + width, device=gen_start.device)
        return col[None] < (gen_start + self.min_tokens)[:, None]

    def _bar_stops(self, logits: torch.Tensor, no_stop: torch.Tensor | None) -> torch.Tensor:
        """The logits with the stop tokens' at -inf: everywhere with --ignore-eos (sequences run to
        gen length), where `no_stop` [R, W] says with --min-tokens; else the logits themselves."""
        if self.ignore_eos:
            return logits.index_fill(-1, self.stop_ids, NEG_INF)
        if no_stop is None:
            return logits
        stop = logits.index_select(-1, self.stop_ids).masked_fill(no_stop[..., None], NEG_INF)
        return logits.index_copy(-1, self.stop_ids, stop)

    def noise(self, logits: torch.Tensor, gens=None, widths: list[int] | None = None) -> torch.Tensor:
        """Standard Gumbel noise of the logits' shape, float64, from the generator (LLaDA's draw) or
        row r's from `gens[r]` (`--sampler row`: the [W, V] draws of a sequence's rows, in order, are
        what one [R, W, V] draw of its generator gives; [widths[r], V] of them where given, the
        columns past that row's end drawing nothing); -inf outside the tokens --top-k / --top-p
        keep, so the Gumbel-max sample is drawn among them. Transformed in place: one float64
        [R, W, V] buffer, not one per operation (the same values as -log(-log(u)))."""
        if self.per_row:
            if gens is None or len(gens) != logits.shape[0]:
                raise ValueError(f"--sampler row draws per row: {logits.shape[0]} rows need as many generators")
            u = torch.empty(logits.shape, device=logits.device, dtype=torch.float64)
            W = logits.shape[1]
            for r, g in enumerate(gens):     # g None: a filler canvas, drawn from no sequence's generator
                w = 0 if g is None else W if widths is None else widths[r]
                if w:
                    torch.rand((w, logits.shape[2]), generator=g, device=logits.device, dtype=torch.float64,
                               out=u[r, :w])
                if w < W:                    # columns nothing is drawn for: any finite noise (never read)
                    u[r, w:] = 0.5
        else:
            u = torch.rand(logits.shape, generator=self.gen, device=logits.device, dtype=torch.float64)
        g = u.clamp_min_(1e-300).log_().neg_().log_().neg_()
        if self.top_k > 0 or self.top_p < 1:
            g.masked_fill_(~self.kept(logits), NEG_INF)
        return g

    def kept(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, W, V] True at the tokens top-k / top-p keep (the mask token never): the k most likely,
        and the most likely ones whose probabilities at the temperature reach top_p (a token is cut
        when the mass before it already does). The confidence stays the untempered softmax of the
        whole vocabulary."""
        x = logits.index_fill(-1, self.stop_ids.new_tensor([self.mask_id]), NEG_INF)
        keep = torch.ones_like(x, dtype=torch.bool)
        if self.top_k > 0:
            keep &= x >= x.topk(min(self.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        if self.top_p < 1:
            p, order = torch.softmax(x.float() / self.temperature, dim=-1).sort(dim=-1, descending=True)
            out = (p.cumsum(-1) - p) >= self.top_p
            keep &= ~torch.zeros_like(out).scatter_(-1, order, out)
        return keep

    def top(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, W, k, 2] float64: the k most likely (id, untempered probability) of every position,
        over the distribution the confidence `prob` is taken from (the mask token excluded)."""
        x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32, copy=True)
        x[..., self.mask_id] = NEG_INF
        logp, ids = torch.log_softmax(x, dim=-1).topk(min(self.top_logprobs, x.shape[-1] - 1), dim=-1)
        return torch.stack((ids.double(), logp.exp().double()), dim=-1)
