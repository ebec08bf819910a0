"""The state the loop carries between model calls: the whole batch, and the rows of one block."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from models import position_ids

from .cache import Window
from .policies import PolicyState


def pad_columns(t: torch.Tensor, left: int, right: int, fill, dim: int = 1) -> torch.Tensor:
    """`t` with `left` columns of `fill` before its first along `dim` (removed if negative) and
    `right` after its last: how every per-column tensor moves when a canvas widens or is trimmed."""
    n = t.shape[dim]
    t = t.narrow(dim, max(0, -left), n - max(0, -left) - max(0, -right))
    shape = list(t.shape)
    parts = []
    for k in (max(0, left), None, max(0, right)):
        if k is None:
            parts.append(t)
        else:
            shape[dim] = k
            parts.append(t.new_full(shape, fill))
    return torch.cat(parts, dim)


def take_rows(v, rows: torch.Tensor):
    """Rows `rows` (indices) of a per-row value of a batch or block: a tensor, a list (--sampler row:
    the rows' generators) or a record that moves its rows itself (`Commits`, `PolicyState`)."""
    if isinstance(v, torch.Tensor):
        return v[rows]
    return [v[i] for i in rows.tolist()] if isinstance(v, list) else v.take(rows)


def put_rows(v, rows: torch.Tensor, other) -> None:
    """Rows `rows` (indices) of the per-row value `v` become `other`'s rows."""
    if isinstance(v, torch.Tensor):
        v[rows] = other.to(v.dtype)
    elif isinstance(v, list):
        for i, r in enumerate(rows.tolist()):
            v[r] = other[i]
    else:
        v.put(rows, other)


def join_rows(a, b):
    """The rows of the per-row value `a`, then of `b`'s."""
    if isinstance(a, torch.Tensor):
        return torch.cat((a, b.to(a.dtype)))
    return a + b if isinstance(a, list) else a.join(b)


@dataclass
class Commits:
    """How each generated position was committed, one record per batch or block ([R, N] tensors, by
    canvas column; `top` [R, N, k, 2]). A new per-token output is one field here (its fill value in
    `FILL`, its host form in `HOST` if not `tolist()`), written where the loop commits; `take`,
    `put`, `write`, `shift` and `join` move every field together, and every field reaches each
    `SequenceResult` as `commit_<field>` (`lists`; engine/results.py names none of them)."""

    call: torch.Tensor             # the call whose output committed it (-1: none)
    step: torch.Tensor             # its step inside the block
    source: torch.Tensor           # 0 = stage 1, 1 = an accepted draft
    prob: torch.Tensor             # float64: its confidence in the output that committed it
    top: torch.Tensor | None = None   # float64 (--top-logprobs k): the (id, probability) of the k most likely
                                      # tokens in the output that committed it (ids exact in float64)

    FILL: ClassVar[dict] = {"call": -1, "step": -1, "source": 0, "prob": 0.0, "top": 0.0}
    HOST: ClassVar[dict] = {"top": lambda t: [[(int(i), p) for i, p in pos] for pos in t.tolist()]}  # (id, prob) pairs

    @classmethod
    def empty(cls, rows: int, columns: int, top_k: int, device) -> "Commits":
        def full(name, *shape, dtype=torch.long):
            return torch.full((rows, columns, *shape), cls.FILL[name], dtype=dtype, device=device)

        return cls(full("call"), full("step"), full("source"), full("prob", dtype=torch.float64),
                   full("top", top_k, 2, dtype=torch.float64) if top_k else None)

    def map(self, fn) -> "Commits":
        return type(self)(**{f.name: None if getattr(self, f.name) is None else fn(f.name, getattr(self, f.name))
                          for f in dataclasses.fields(self)})

    def kept(self) -> list[str]:
        """The fields this record keeps (`top` only with --top-logprobs)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def lists(self, row: int, cols=slice(None)) -> dict:
        """Row `row`'s columns `cols` of every field this record keeps, as Python lists by field name
        (one host read per field: call it on a record already on the host)."""
        return {name: self.HOST.get(name, torch.Tensor.tolist)(getattr(self, name)[row, cols]) for name in self.kept()}

    def take(self, rows=slice(None), cols=slice(None)) -> "Commits":
        """A copy of rows `rows` (indices or a slice), columns `cols`."""
        return self.map(lambda _, t: t[rows, cols])

    def put(self, rows, other: "Commits", cols=slice(None)) -> None:
        """Write `other` into rows `rows`, columns `cols` (`PolicyState.put`'s order)."""
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                getattr(self, f.name)[rows, cols] = getattr(other, f.name)

    def write(self, where: torch.Tensor, rows=slice(None), cols=slice(None), **values) -> None:
        """At the positions `where` [R', W'] of rows `rows` and columns `cols`, set each field named
        in `values` to its value (broadcast to the positions; `top`'s trailing [k, 2] too); a field
        this record does not keep (top without --top-logprobs) is skipped."""
        for name, value in values.items():
            t = getattr(self, name)
            if t is None:
                continue
            at = where if t.dim() == 2 else where[..., None, None]
            t[rows, cols] = torch.where(at, value, t[rows, cols])

    def shift(self, left: int, right: int) -> "Commits":
        """`left` fill columns before the first (removed if negative), `right` after the last."""
        return self.map(lambda name, t: pad_columns(t, left, right, self.FILL[name]))

    def join(self, other: "Commits") -> "Commits":
        """These rows, then `other`'s (same columns)."""
        return self.map(lambda name, t: torch.cat((t, getattr(other, name).to(t.dtype))))


@dataclass
class Batch:
    """The canvas of every sequence and its running statistics (on the model's device).

    Every per-position tensor is in canvas columns. Rows may have started at different times
    (`engine.live`: continuous batching) and want different lengths, but their block boundaries
    are aligned: every row's generation starts at a column congruent to `prompt_width` modulo the
    block length, so one block column (`cursor`) is every row's current block, whatever its index."""

    x: torch.Tensor                # [B, N] left-padded prompts, then the generation, then right padding
    valid: torch.Tensor            # [B, N] False at padding (left and right)
    pos: torch.Tensor              # [B, N] position ids
    prompt_width: int              # P: the batch's block grid (block 0 of its first rows starts here)
    gen_start: torch.Tensor        # [B] column of each row's first generated position
    gen_len: torch.Tensor          # [B] positions each row generates
    cursor: int                    # column of the next block to decode
    calls: torch.Tensor            # [B] model calls each sequence took part in
    rows: torch.Tensor             # [B] canvases evaluated for it (drafts count)
    stop_at: torch.Tensor          # [B] column of the stop token, -1 while none
    commits: Commits               # [B, N] per generated position: how it was committed
    depth_hist: torch.Tensor       # [B, D + 1] accepted depth per verification call
    nodes_hist: torch.Tensor       # [B, K + 1] the plan's graph nodes per verification call (draft budget)
    carry_pred: torch.Tensor       # [B, L] --cross-block: the next block's prediction by the call that
    carry_conf: torch.Tensor       # [B, L]   completed this one (a kept draft), valid where carry_ok
    carry_ok: torch.Tensor         # [B] bool
    carry_step: torch.Tensor       # [B] the step inside the next block its kept draft reached
    policy_state: PolicyState | None = None   # the policy's per-sequence state (Policy.init_state)
    pad_id: int = 0                # the token at padded columns (never the mask id)
    gens: list | None = None       # --sampler row: each row's sampling generator (Sampler.generators); None otherwise
    out_len: torch.Tensor | None = None      # [B] generated positions a result keeps (None: gen_len); fewer
                                             # with --align sequence, whose last block runs past gen length
    retired: torch.Tensor | None = None      # [B] bool: the row left the batch inside a block (Decoder.leave):
                                             # it takes no further call (None: no row did)
    span: int = 0                            # host-side bound: every row's valid columns lie within `span` columns
                                             # from its first (0: unknown); packed calls (engine/cache.py) use it
    memory: object = None                    # uniform-noise models (engine/uniform.py): (the encoder's KVCache of
                                             # the columns before the cursor, how many columns it holds)

    @property
    def end(self) -> int:
        """One past the last column any row generates."""
        return self.x.shape[1]

    # ---------------------------------------------------------------- rows leave and join (engine.live)
    def _columns(self):
        """(name, value at a padded column) of every [B, N] tensor."""
        return (("x", self.pad_id), ("valid", False))

    def _per_row(self) -> tuple[str, ...]:
        """Every field with one entry per row."""
        return self._rows() + tuple(n for n, _ in self._columns()) + ("pos", "policy_state", "commits", "gens")

    def _rows(self):
        return ("gen_start", "gen_len", "out_len", "retired", "calls", "rows", "stop_at", "depth_hist", "nodes_hist", "carry_pred",
                "carry_conf", "carry_ok", "carry_step")

    def take(self, rows: torch.Tensor) -> "Batch":
        """The batch of these rows only (same columns)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in self._per_row():
            v = getattr(self, name)
            kw[name] = None if v is None else take_rows(v, rows)
        return Batch(**kw)

    def shift(self, left: int, right: int, position_ids) -> "Batch":
        """The same rows with `left` padded columns added before the first (removed if negative)
        and `right` after the last; every column index moves with them. `position_ids(valid)`
        recomputes the positions."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, fill in self._columns():
            v = getattr(self, name)
            if v is not None:
                kw[name] = pad_columns(v, left, right, fill)
        kw["gen_start"] = self.gen_start + left
        kw["stop_at"] = torch.where(self.stop_at >= 0, self.stop_at + left, self.stop_at)
        kw["cursor"], kw["prompt_width"] = self.cursor + left, self.prompt_width + left
        kw["pos"] = position_ids(kw["valid"])
        kw["policy_state"] = None if self.policy_state is None else self.policy_state.shift(left, right)
        kw["commits"] = self.commits.shift(left, right)
        return Batch(**kw)

    def trim_shift(self, keep: int = 0) -> tuple[int, int, int]:
        """(left, right, span): the `shift` that removes the columns before every row's first valid
        one (but `keep` before the cursor: a shifted model reads a block's first prediction one
        column before it) and after every row's last generated one, and the rows' exact span (one read)."""
        starts = self.valid.to(torch.uint8).argmax(1)          # each row's first valid column
        ends = self.gen_start + self.gen_len
        first, last, span = torch.stack((starts.min(), ends.max(), (ends - starts).max())).tolist()   # one read
        return -min(first, max(0, self.cursor - keep)), -(self.x.shape[1] - last), span

    def trimmed(self, position_ids, keep: int = 0) -> "Batch":
        """Without the columns before every row's first valid one (but `keep` before the cursor) and
        after every row's last generated one (a running batch does not grow without bound)."""
        left, right, span = self.trim_shift(keep)
        trimmed = self.shift(left, right, position_ids)
        trimmed.span = span                   # exact again (rows that left may have been the longest)
        return trimmed

    def scroll(self, rows: torch.Tensor, by: int, position_ids) -> None:
        """Rows `rows` moved `by` columns left on the canvas (their first `by` columns are padding),
        every per-column record with them: how a rolling row's next block comes to the open block's
        window (docs/loop.md, "Rolling rows")."""
        for name, fill in self._columns():
            v = getattr(self, name)
            v[rows] = pad_columns(v[rows], -by, by, fill)
        self.pos = position_ids(self.valid)
        self.gen_start[rows] -= by
        self.stop_at[rows] = torch.where(self.stop_at[rows] >= 0, self.stop_at[rows] - by, self.stop_at[rows])
        for rec in (self.commits, self.policy_state):
            if rec is not None:
                rec.put(rows, rec.take(rows).shift(-by, by))


def join(a: Batch, b: Batch, position_ids) -> Batch:
    """The rows of `a` and then of `b`, aligned so that both cursors are one column: the block
    each row decodes next starts there (a row of `b` is at its first block)."""
    da, db = max(0, b.cursor - a.cursor), max(0, a.cursor - b.cursor)
    na, nb = a.x.shape[1] + da, b.x.shape[1] + db
    a, b = a.shift(da, max(0, nb - na), position_ids), b.shift(db, max(0, na - nb), position_ids)
    if (a.retired is None) != (b.retired is None):         # one side had a row leave inside a block
        a.retired, b.retired = (torch.zeros_like(v.stop_at, dtype=torch.bool) if v.retired is None else v.retired
                                for v in (a, b))
    kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(a)}
    for name in a._per_row():
        va = getattr(a, name)
        kw[name] = None if va is None else join_rows(va, getattr(b, name))
    kw["span"] = max(a.span, b.span) if a.span and b.span else 0
    return Batch(**kw)


@dataclass
class BlockRun:
    """The rows decoding one block, between two model calls. Every tensor has one row per
    sequence still on this block ([S, ...]); the window holds W positions."""

    index: int
    seqs: torch.Tensor             # [S] batch index of each row
    win: Window
    gen_start: torch.Tensor        # [S] column of each row's first generated position
    x: torch.Tensor                # [S, N] canvases
    valid: torch.Tensor
    pos: torch.Tensor
    cache: object                  # the block's KV cache (None without a cache mode)
    pred: torch.Tensor             # [S, W] latest verifier output: top-1 tokens
    conf: torch.Tensor             # [S, W] and their confidences
    calls: torch.Tensor            # [S] running totals, as in Batch
    rows: torch.Tensor
    step: torch.Tensor             # [S] step index inside the block
    stop_at: torch.Tensor          # [S] column of the stop token, -1 while none
    pending: torch.Tensor          # [S] still needs a call on this block
    commits: Commits               # [S, W + ahead] (--cross-block: drafts reach the next block)
    depth_hist: torch.Tensor       # [S, D + 1]
    failed: torch.Tensor           # [S] 0, or why the row stopped making progress (engine.progress.guard_progress)
    failed_call: torch.Tensor      # [S] the call whose output it could not use, -1 while none
    nodes_hist: torch.Tensor       # [S, K + 1]
    plan: object                   # engine.graph.Plan: the draft nodes this block verifies
    ahead_pred: torch.Tensor | None = None   # [S, L] --cross-block: the latest output's next-block part
    ahead_conf: torch.Tensor | None = None
    carry: torch.Tensor | None = None        # [S] bool: that output is of the completed block
    ahead_step: torch.Tensor | None = None   # [S] the kept draft's step inside the next block (0: none)
    ahead_ok: torch.Tensor | None = None     # [S] bool: ahead_* hold the latest output's next block
    policy_state: PolicyState | None = None  # its rows' Batch.policy_state, columns cut to [S, W + ahead]
    top: torch.Tensor | None = None          # [S, W, k, 2] the latest output's k most likely (id, prob) (--top-logprobs)
    post: torch.Tensor | None = None         # [S] token editing (Policy.edits): editing passes taken on the
                                             # block after its last mask was filled; None without editing
    noise: object = None                     # uniform-noise models: the block's denoising state (uniform.Canvas)
    gens: list | None = None                 # --sampler row: each row's sampling generator (Batch.gens)
    first: torch.Tensor | None = None        # [S] bool: the row's block has had no call yet (rolling rows,
                                             # `Decoder.start(rolling=True)`: its first call rides on the next one)
    cache_rows: torch.Tensor | None = None   # [S] each row's row in `cache` (None: row i's is i); rows that left
                                             # the open block (`Decoder.leave`) leave theirs behind until it closes

    def block(self, rows=slice(None)) -> torch.Tensor:
        return self.x[rows, self.win.lo:self.win.hi]

    SHARED: ClassVar[tuple] = ("index", "win", "plan", "cache", "cache_rows")   # one per block, not per row

    def take(self, rows: torch.Tensor) -> "BlockRun":
        """The run of rows `rows` (indices) only, on the same cache (a mode without one: rolling rows)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, v in kw.items():
            if name not in self.SHARED and v is not None:
                kw[name] = take_rows(v, rows)
        if self.cache is not None or self.cache_rows is not None:
            kw["cache_rows"] = self.rows_in_cache()[rows]
        return BlockRun(**kw)

    def put(self, rows: list[int], other: "BlockRun") -> None:
        """Rows `rows` (indices) become `other`'s rows (the same block window and plan)."""
        at = torch.tensor(rows, device=self.x.device)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name not in self.SHARED and v is not None:
                put_rows(v, at, getattr(other, f.name))

    def joined(self, other: "BlockRun", cache=None) -> "BlockRun":
        """These rows, then `other`'s (the same block, window and plan: rows that opened the block
        later, `Decoder.join`); every per-row value joined row-wise (`join_rows`); `cache`, the two
        caches joined (the cache mode's `joined`)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, v in kw.items():
            if name not in self.SHARED and v is not None:
                kw[name] = join_rows(v, getattr(other, name))
        kw["cache"], kw["cache_rows"] = cache, None
        if self.cache_rows is not None or other.cache_rows is not None:   # the joined cache: ours, then theirs
            kw["cache_rows"] = torch.cat((self.rows_in_cache(), other.rows_in_cache() + self.cache.key_mask.shape[0]))
        return BlockRun(**kw)

    def rows_in_cache(self, rows=slice(None)) -> torch.Tensor:
        """The cache rows of rows `rows` (what a cache mode's call takes as its `rows`)."""
        if self.cache_rows is None:
            return torch.arange(self.seqs.numel(), device=self.seqs.device)[rows]
        return self.cache_rows[rows]

    def retire(self, rows) -> None:
        """These rows (indices into the run) take no further call on this block: they commit nothing
        more and every later call leaves them out (a cancelled sequence, engine.live)."""
        self.pending[rows] = False


@dataclass
class BatchState:
    """A running batch between two model calls (`Decoder.start`, `Decoder.step`): every row's canvas
    and per-token record (`batch`) and the rows of the open block (`run`; None at a block boundary,
    where rows may join, `Decoder.join`, and leave, `Decoder.leave`). A row may also leave the open
    block between any two steps (`Decoder.leave` retires it: no later call includes it)."""

    batch: Batch | None
    run: BlockRun | None = None
    live: bool = False           # rows may join later (continuous batching): `step` stops at every block
                                 # boundary, even one with no row to decode, and never ends the batch itself
    rolling: bool = False        # rows keep their own block cursors (`Decoder.start(rolling=True)`)
    done: bool = False           # nothing left to decode (set by `step` when not live)
    t0: float = 0.0              # when the batch started (perf_counter), for results' seconds
    sent: list[int] = dataclasses.field(default_factory=list)   # per batch row: generated tokens handed
                                 # out by `StepOutput.final` (rows join and leave with theirs)
    version: int = 0             # counts the changes (steps, joins, leaves): a StepOutput's final()
                                 # is read only while its state is the one its step left
    broken: str = ""             # why a step stopped halfway (an error in its model call, an interrupt):
                                 # the batch cannot go on (`Decoder.step` says so); "" while it can

    @property
    def at_boundary(self) -> bool:
        return self.run is None


def state_of(run: BlockRun, rows=slice(None), span=slice(None)) -> PolicyState | None:
    """The policy state of the run's rows `rows`, its columns cut to `span` (columns of the run's
    window: 0 is its first); None for a stateless policy."""
    return None if run.policy_state is None else run.policy_state.take(rows, span)


def layout(prompt_lengths: list[int], gen_lengths: list[int], block_length: int, aligned: bool = False):
    """Per row, (prompt tokens inside its first block, positions it decodes): (0, its gen length),
    or with `aligned` the prompt's tail past the grid and its gen length to the end of its block.
    A row's canvas reaches lead + decoded columns past the batch's cursor (`new_batch`)."""
    L = block_length
    lead = [n % L if aligned else 0 for n in prompt_lengths]
    return lead, [-(-(a + g) // L) * L - a if aligned else g for a, g in zip(lead, gen_lengths)]


def new_batch(mc, prompts: list[list[int]], gen_length: int | list[int], block_length: int, depth: int,
              nodes: int, device, top_logprobs: int = 0, aligned: bool = False) -> Batch:
    """Prompts left-padded to one width, then `gen_length` masks (one length, or one per prompt:
    shorter ones are right-padded); every statistic at zero (`commits.top` only with `top_logprobs`).

    `aligned` (--align sequence): blocks are counted from each sequence's first token. A row's
    prompt then starts at a block boundary of the batch's grid, so the block holding its prompt's
    end is a block of the grid too and opens at the cursor with the other rows' first blocks (its
    prompt part is not masked, so never committed); each row generates to the end of the block
    holding its last position, and its result keeps `gen_length` of them (`Batch.out_len`)."""
    B, L = len(prompts), block_length
    lengths = [gen_length] * B if isinstance(gen_length, int) else list(gen_length)
    lead, decoded = layout([len(p) for p in prompts], lengths, L, aligned)
    P = max(len(p) - a for p, a in zip(prompts, lead))                      # the grid's first block column
    if P < mc.logit_shift:   # aligned prompts inside one block: a shifted model reads column lo's logits at lo - 1
        P += L
    N = P + max(a + d for a, d in zip(lead, decoded))
    pad = mc.pad_token_id if mc.pad_token_id is not None else mc.eos_token_id
    x = torch.full((B, N), pad, dtype=torch.long, device=device)
    valid = torch.zeros(B, N, dtype=torch.bool, device=device)
    for b, (p, a, d) in enumerate(zip(prompts, lead, decoded)):
        x[b, P + a - len(p):P + a] = torch.tensor(p, device=device)
        x[b, P + a:P + a + d] = mc.mask_token_id if mc.mask_token_id is not None else pad   # uniform noise: drawn
        valid[b, P + a - len(p):P + a + d] = True

    def zeros(*shape, dtype=torch.long):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return Batch(x=x, valid=valid, pos=position_ids(mc, valid), prompt_width=P,
                 gen_start=torch.tensor(lead, device=device) + P,
                 gen_len=torch.tensor(decoded, device=device), cursor=P, calls=zeros(B), rows=zeros(B),
                 stop_at=zeros(B) - 1, commits=Commits.empty(B, N, top_logprobs, device),
                 depth_hist=zeros(B, depth + 1), nodes_hist=zeros(B, nodes + 1),
                 carry_pred=zeros(B, block_length), carry_conf=zeros(B, block_length, dtype=torch.float32),
                 carry_ok=zeros(B, dtype=torch.bool), carry_step=zeros(B), pad_id=pad,
                 out_len=torch.tensor(lengths, device=device), span=max(len(p) + d for p, d in zip(prompts, decoded)))
