"""psd_kernels draft family: rank_positions, position_ranks, assemble_drafts (Triton vs reference and semantics)."""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import psd_kernels
from psd_kernels import reference
from support import compiled_only

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
BACKENDS = ["reference"] + (["triton"] if HAS_TRITON else [])
# the longest block: 256 rank chunks of 4 (psd_kernels.ops.draft.launch_config); L=200, 13 chunks of 16 with the
# last partial, takes the same path at a fraction of the interpreter's time
LONG = compiled_only(1023, "L=200")


def make_row_state(B, L, gen, device, density=0.6, tie_levels=None):
    """Random block state; tie_levels quantises conf so equal confidences are common."""
    if tie_levels:
        conf = torch.randint(0, tie_levels, (B, L), generator=gen).float() / tie_levels
    else:
        conf = torch.rand(B, L, generator=gen)
    masked = torch.rand(B, L, generator=gen) < density
    block = torch.randint(0, 1000, (B, L), generator=gen)
    pred = torch.randint(1000, 2000, (B, L), generator=gen)  # disjoint from block: every write shows
    return [t.to(device) for t in (block, masked, pred, conf)]


def naive_order(conf_row, masked_row):
    """σ by the contract: masked positions, confidence descending, lower position first."""
    pos = [i for i in range(len(conf_row)) if masked_row[i]]
    return sorted(pos, key=lambda i: (-conf_row[i], i))


def random_node_ranks(K, D, L, gen, device):
    ranks = torch.randint(0, L + 2, (K, D), generator=gen)  # some ranks beyond any masked count
    ranks[torch.rand(K, D, generator=gen) < 0.3] = -1
    ranks[0] = -1  # the root
    return ranks.to(device)


# ------------------------------------------------------------------------------------------
# rank_positions
# ------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("L", [1, 7, 32, 100])
@pytest.mark.parametrize("tie_levels", [None, 3])
@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_rank_positions_matches_reference(B, L, tie_levels, density, device):
    gen = torch.Generator().manual_seed(B * 1000 + L + (tie_levels or 0) + int(density * 10))
    _, masked, _, conf = make_row_state(B, L, gen, device, density, tie_levels)
    order = torch.full((B, L), -7, dtype=torch.int64, device=device)
    n = torch.full((B,), -7, dtype=torch.int64, device=device)
    got = psd_kernels.rank_positions(conf, masked, (order, n), backend="triton")
    assert got[0] is order and got[1] is n
    want = reference.rank_positions(conf.cpu(), masked.cpu())
    assert torch.equal(order.cpu(), want[0])
    assert torch.equal(n.cpu(), want[1])


@needs_triton
@pytest.mark.parametrize("tie_levels", [None, 40])
def test_rank_positions_long_block(tie_levels, device):
    """L = 1024: the all-pairs count runs in BLOCK_J-wide chunks (BLOCK_J < BLOCK_L)."""
    gen = torch.Generator().manual_seed(1024 + (tie_levels or 0))
    _, masked, _, conf = make_row_state(1, 1024, gen, device, 0.5, tie_levels)
    got = psd_kernels.rank_positions(conf, masked, backend="triton")
    want = reference.rank_positions(conf.cpu(), masked.cpu())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_rank_positions_naive(backend, data):
    device = DEVICE
    B = data.draw(st.integers(1, 3))
    L = data.draw(st.integers(1, 12))
    levels = data.draw(st.sampled_from([2, 3, 1000]))
    conf = torch.tensor(data.draw(st.lists(st.integers(0, levels - 1), min_size=B * L, max_size=B * L)),
                        dtype=torch.float32).view(B, L) / levels
    masked = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B * L, max_size=B * L))).view(B, L)
    order, n = psd_kernels.rank_positions(conf.to(device), masked.to(device), backend=backend)
    for b in range(B):
        sigma = naive_order(conf[b].tolist(), masked[b].tolist())
        assert n[b].item() == len(sigma)
        assert order[b].tolist() == sigma + [-1] * (L - len(sigma))


def test_rank_positions_tie_rule_example(device):
    conf = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1, 0.99]], device=device)
    masked = torch.tensor([[True, True, True, True, True, False]], device=device)  # 0.99 is not masked: never ranked
    for backend in BACKENDS:
        order, n = psd_kernels.rank_positions(conf, masked, backend=backend)
        assert order.tolist() == [[1, 3, 0, 2, 4, -1]] and n.tolist() == [5]


# ------------------------------------------------------------------------------------------
# assemble_drafts
# ------------------------------------------------------------------------------------------
def naive_drafts(block, masked, pred, conf, node_ranks):
    B, L = block.shape
    K = node_ranks.shape[0]
    drafts = block[:, None, :].repeat(1, K, 1)
    valid = torch.ones(B, K, dtype=torch.bool)
    for b in range(B):
        sigma = naive_order(conf[b].tolist(), masked[b].tolist())
        for k in range(K):
            for r in node_ranks[k].tolist():
                if r < 0:
                    continue
                if r < len(sigma):
                    drafts[b, k, sigma[r]] = pred[b, sigma[r]]
                else:
                    valid[b, k] = False
    return drafts, valid


@needs_triton
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("L", [1, 7, 32])
@pytest.mark.parametrize("K", [1, 3, 8])
@pytest.mark.parametrize("D", [1, 4])
def test_assemble_drafts_matches_reference(B, L, K, D, device):
    gen = torch.Generator().manual_seed(B * 100 + L * 10 + K + D * 1000)
    block, masked, pred, conf = make_row_state(B, L, gen, device, tie_levels=4)
    node_ranks = random_node_ranks(K, D, L, gen, device)
    want = reference.assemble_drafts(*(t.cpu() for t in (block, masked, pred, conf, node_ranks)))
    drafts = torch.full((B, K, L), -7, dtype=torch.int64, device=device)
    valid = ~want[1].to(device)  # poison: every flag must be written
    got = psd_kernels.assemble_drafts(block, masked, pred, conf, node_ranks, (drafts, valid), backend="triton")
    assert got[0] is drafts and got[1] is valid
    assert torch.equal(drafts.cpu(), want[0])
    assert torch.equal(valid.cpu(), want[1])


@needs_triton
def test_assemble_drafts_several_node_tiles_and_strides(device):
    """L = 1024 gives BLOCK_K < K (two node tiles) and a chunked rank loop; inputs are strided views."""
    gen = torch.Generator().manual_seed(21)
    B, L, K, D = 2, 1024, 8, 3
    block, masked, pred, conf = make_row_state(B, 2 * L, gen, device, tie_levels=50)
    block, masked, pred, conf = (t[:, ::2] for t in (block, masked, pred, conf))
    node_ranks = random_node_ranks(K, 2 * D, 600, gen, device)[:, ::2]
    want = reference.assemble_drafts(*(t.cpu() for t in (block, masked, pred, conf, node_ranks)))
    got = psd_kernels.assemble_drafts(block, masked, pred, conf, node_ranks, backend="triton")
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_assemble_drafts_naive(backend, device):
    gen = torch.Generator().manual_seed(4)
    B, L = 3, 9
    block, masked, pred, conf = make_row_state(B, L, gen, "cpu", tie_levels=3)
    masked[2] = False  # a row with nothing left: only nodes without ranks are valid
    node_ranks = torch.tensor([[-1, -1, -1], [0, -1, -1], [0, 1, -1], [1, -1, -1], [0, 1, 2], [3, 8, -1]])
    want = naive_drafts(block, masked, pred, conf, node_ranks)
    got = psd_kernels.assemble_drafts(*(t.to(device) for t in (block, masked, pred, conf, node_ranks)), backend=backend)
    assert torch.equal(got[0].cpu(), want[0])
    assert torch.equal(got[1].cpu(), want[1])
    assert got[1][2].tolist() == [True, False, False, False, False, False]
    assert torch.equal(got[0][:, 0].cpu(), block)  # the root is the block itself


@pytest.mark.parametrize("backend", BACKENDS)
def test_assemble_drafts_without_rank_columns(backend, device):
    gen = torch.Generator().manual_seed(6)
    block, masked, pred, conf = make_row_state(2, 5, gen, device)
    drafts, valid = psd_kernels.assemble_drafts(block, masked, pred, conf,
                                                torch.empty(3, 0, dtype=torch.int64, device=device), backend=backend)
    assert torch.equal(drafts, block[:, None].expand(2, 3, 5)) and bool(valid.all())


# ------------------------------------------------------------------------------------------
# position_ranks
# ------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("L", [3, 47, 200, LONG])
@pytest.mark.parametrize("tie_levels", [None, 3])
@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_position_ranks_matches_reference(B, L, tie_levels, density, device):
    """Odd sizes: 47 leaves a partial row tile, 200 and 1023 a chunked rank loop (BLOCK_J < BLOCK_L) with a
    partial last chunk."""
    gen = torch.Generator().manual_seed(B * 10000 + L + (tie_levels or 0) + int(density * 10))
    _, masked, _, conf = make_row_state(B, L, gen, device, density, tie_levels)
    ranks = torch.full((B, L), -7, dtype=torch.int64, device=device)  # poison: every slot must be written
    n = torch.full((B,), -7, dtype=torch.int64, device=device)
    got = psd_kernels.position_ranks(conf, masked, (ranks, n), backend="triton")
    assert got[0] is ranks and got[1] is n
    want = reference.position_ranks(conf.cpu(), masked.cpu())
    assert torch.equal(ranks.cpu(), want[0])
    assert torch.equal(n.cpu(), want[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L", [1, 3, 47, 200, LONG])
@pytest.mark.parametrize("tie_levels", [None, 2, 40])
def test_position_ranks_inverts_rank_positions(backend, L, tie_levels, device):
    """order[b, ranks[b, i]] == i at masked i, -1 elsewhere, and the masked ranks fill 0..n-1."""
    gen = torch.Generator().manual_seed(L * 3 + (tie_levels or 0))
    B = 3
    _, masked, _, conf = make_row_state(B, L, gen, device, 0.6, tie_levels)
    masked[1] = False  # a row with nothing left to rank
    order, n_order = psd_kernels.rank_positions(conf, masked, backend=backend)
    ranks, n = psd_kernels.position_ranks(conf, masked, backend=backend)
    assert ranks.dtype == torch.int64 and n.dtype == torch.int64
    assert torch.equal(n, n_order) and torch.equal(n, masked.sum(-1))
    assert torch.equal(ranks[~masked], torch.full_like(ranks[~masked], -1))
    for b in range(B):
        pos = masked[b].nonzero().flatten()
        r = ranks[b, pos]
        assert sorted(r.tolist()) == list(range(int(n[b])))
        assert torch.equal(order[b, r], pos)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_position_ranks_naive(backend, data):
    device = DEVICE
    B = data.draw(st.integers(1, 3))
    L = data.draw(st.integers(1, 12))
    levels = data.draw(st.sampled_from([2, 3, 1000]))
    conf = torch.tensor(data.draw(st.lists(st.integers(0, levels - 1), min_size=B * L, max_size=B * L)),
                        dtype=torch.float32).view(B, L) / levels
    masked = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B * L, max_size=B * L))).view(B, L)
    ranks, n = psd_kernels.position_ranks(conf.to(device), masked.to(device), backend=backend)
    for b in range(B):
        sigma = naive_order(conf[b].tolist(), masked[b].tolist())
        assert n[b].item() == len(sigma)
        assert ranks[b].tolist() == [sigma.index(i) if masked[b, i] else -1 for i in range(L)]


def test_position_ranks_tie_rule_example(device):
    conf = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1, 0.99]], device=device)
    masked = torch.tensor([[True, True, True, True, True, False]], device=device)  # 0.99 is not masked: never ranked
    for backend in BACKENDS:
        ranks, n = psd_kernels.position_ranks(conf, masked, backend=backend)
        assert ranks.tolist() == [[2, 0, 3, 1, 4, -1]] and n.tolist() == [5]


@needs_triton
def test_position_ranks_strided_inputs_and_outputs(device):
    """Strided views in and out: the kernel uses every stride, never assumes contiguity."""
    gen = torch.Generator().manual_seed(23)
    B, L = 3, 300
    _, masked, _, conf = make_row_state(B, 2 * L, gen, device, 0.5, tie_levels=20)
    conf, masked = conf[:, 1::2], masked[:, ::2]
    ranks_t = torch.full((L, B), -7, dtype=torch.int64, device=device)  # ranks written through a transpose
    n_wide = torch.full((B, 2), -7, dtype=torch.int64, device=device)
    got = psd_kernels.position_ranks(conf, masked, (ranks_t.t(), n_wide[:, 1]), backend="triton")
    want = reference.position_ranks(conf.cpu(), masked.cpu())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(ranks_t.t().cpu(), want[0])
    assert torch.equal(n_wide[:, 1].cpu(), want[1])
    assert bool((n_wide[:, 0] == -7).all())  # nothing outside the view is touched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B, L", [(0, 5), (3, 0), (0, 0)])
def test_position_ranks_empty(backend, B, L, device):
    conf = torch.rand(B, L, device=device)
    masked = torch.ones(B, L, dtype=torch.bool, device=device)
    ranks, n = psd_kernels.position_ranks(conf, masked, backend=backend)
    assert ranks.shape == (B, L) and ranks.dtype == torch.int64
    assert n.tolist() == [0] * B and n.dtype == torch.int64


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_ranks_bad_inputs_like_rank_positions(backend, device):
    """Both functions validate through check_rank_args: the same calls fail with the same errors."""
    _, masked, _, conf = _state(device=device)
    bad = [
        ((conf[0], masked[0]), "conf must be 2-D"),
        ((conf, masked.int()), "masked must be torch.bool"),
        ((conf.double(), masked), "conf must be torch.float32"),
        ((conf, masked[:, :3]), "masked has shape"),
        ((conf.tolist(), masked), "conf must be a tensor"),
    ]
    for args, match in bad:
        for fn in (psd_kernels.rank_positions, psd_kernels.position_ranks):
            with pytest.raises(ValueError, match=match):
                fn(*args, backend=backend)


@needs_triton
def test_position_ranks_bad_out_buffers(device):
    _, masked, _, conf = _state(device=device)
    n = torch.empty(2, dtype=torch.int64, device=device)
    bad = [
        ((torch.empty(2, 4, dtype=torch.int64, device=device), n), "out buffer ranks"),
        ((torch.empty(2, 5, dtype=torch.int32, device=device), n), "out buffer ranks"),
        ((torch.empty(2, 5, dtype=torch.int64, device=device), n[:1]), "out buffer n_masked"),
        ((torch.empty(2, 5, dtype=torch.int64, device=device), n.int()), "out buffer n_masked"),
        (torch.empty(2, 5, dtype=torch.int64, device=device), "out must be a pair"),
        ((n,), "out must be a pair"),
    ]
    for out, match in bad:
        with pytest.raises(ValueError, match=match):
            psd_kernels.position_ranks(conf, masked, out, backend="triton")


# ------------------------------------------------------------------------------------------
# input checks
# ------------------------------------------------------------------------------------------
def _state(B=2, L=5, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return make_row_state(B, L, gen, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs(backend, device):
    block, masked, pred, conf = _state(device=device)
    ranks = torch.tensor([[-1], [0]], device=device)
    with pytest.raises(ValueError, match="conf must be 2-D"):
        psd_kernels.rank_positions(conf[0], masked[0], backend=backend)
    with pytest.raises(ValueError, match="masked must be torch.bool"):
        psd_kernels.rank_positions(conf, masked.int(), backend=backend)
    with pytest.raises(ValueError, match="conf must be torch.float32"):
        psd_kernels.rank_positions(conf.double(), masked, backend=backend)
    with pytest.raises(ValueError, match="pred has shape"):
        psd_kernels.assemble_drafts(block, masked, pred[:, :3], conf, ranks, backend=backend)
    with pytest.raises(ValueError, match="block must be torch.int64"):
        psd_kernels.assemble_drafts(block.int(), masked, pred, conf, ranks, backend=backend)
    with pytest.raises(ValueError, match="node_ranks must be torch.int64"):
        psd_kernels.assemble_drafts(block, masked, pred, conf, ranks.int(), backend=backend)
    with pytest.raises(ValueError, match="node_ranks must be a 2-D"):
        psd_kernels.assemble_drafts(block, masked, pred, conf, ranks[:, 0], backend=backend)


@needs_triton
def test_triton_bad_out_buffers(device):
    block, masked, pred, conf = _state(device=device)
    ranks = torch.tensor([[-1], [0]], device=device)
    with pytest.raises(ValueError, match="out buffer drafts"):
        psd_kernels.assemble_drafts(block, masked, pred, conf, ranks,
                                    (torch.empty(2, 2, 4, dtype=torch.int64, device=device),
                                     torch.empty(2, 2, dtype=torch.bool, device=device)), backend="triton")
    with pytest.raises(ValueError, match="out must be a pair"):
        psd_kernels.rank_positions(conf, masked, torch.empty(2, 5, dtype=torch.int64, device=device), backend="triton")


def _bad_outs(device):
    """(op, its inputs, out, what the ValueError says) for out buffers the ops must refuse."""
    block, masked, pred, conf = _state(device=device)                    # B = 2, L = 5
    ranks = torch.tensor([[-1], [0], [1]], device=device)               # K = 3
    i64 = dict(dtype=torch.int64, device=device)
    n = torch.empty(2, **i64)
    drafts, valid = torch.empty(2, 3, 5, **i64), torch.empty(2, 3, dtype=torch.bool, device=device)
    rank_in, draft_in = (conf, masked), (block, masked, pred, conf, ranks)
    rank = psd_kernels.rank_positions
    pos = psd_kernels.position_ranks
    draft = psd_kernels.assemble_drafts
    return [
        (rank, rank_in, (torch.empty(2, 5, dtype=torch.int32, device=device), n),
         "out buffer order must be torch.int64 \\(2, 5\\)"),
        (rank, rank_in, (torch.empty(2, 4, **i64), n), "out buffer order"),
        (rank, rank_in, (torch.empty(2, 5, **i64), n.float()), "out buffer n_masked must be torch.int64"),
        (rank, rank_in, (torch.empty(2, 5, **i64), torch.empty(2, device="meta", dtype=torch.int64)), "on meta"),
        (rank, rank_in, torch.empty(2, 5, **i64), "out must be a pair \\(order, n_masked\\)"),
        (pos, rank_in, (torch.empty(2, 5, dtype=torch.int32, device=device), n), "out buffer ranks must be"),
        (pos, rank_in, (torch.empty(2, 5, **i64), n[:1]), "out buffer n_masked"),
        (pos, rank_in, (n,), "out must be a pair \\(ranks, n_masked\\)"),
        (draft, draft_in, (drafts[:, :2], valid), "out buffer drafts must be torch.int64 \\(2, 3, 5\\)"),
        (draft, draft_in, (drafts.int(), valid), "out buffer drafts"),
        (draft, draft_in, (drafts, valid.to(torch.uint8)), "out buffer valid must be torch.bool"),
        (draft, draft_in, (drafts, "valid"), "out buffer valid must be a tensor"),
        (draft, draft_in, [drafts], "out must be a pair \\(drafts, valid\\)"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_out_buffers_fail_alike_on_both_backends(case, device):
    """The reference checks out= as the Triton launchers do (it accepted e.g. an int32 order buffer
    and wrote into it): the same ValueError, message included, on both backends."""
    fn, args, out, match = _bad_outs(device)[case]
    said = {}
    for backend in BACKENDS:
        with pytest.raises(ValueError) as e:
            fn(*args, out, backend=backend)
        said[backend] = str(e.value)
    assert re.search(match, said["reference"]), said
    assert len(set(said.values())) == 1, said


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_buffers_receive_the_results(backend, device):
    block, masked, pred, conf = _state(device=device)
    ranks = torch.tensor([[-1], [0], [1]], device=device)
    for fn, args, shapes in ((psd_kernels.rank_positions, (conf, masked), ((2, 5), (2,))),
                             (psd_kernels.position_ranks, (conf, masked), ((2, 5), (2,))),
                             (psd_kernels.assemble_drafts, (block, masked, pred, conf, ranks), ((2, 3, 5), (2, 3)))):
        want = getattr(reference, fn.__name__)(*args)
        out = tuple(torch.full(s, -7, dtype=w.dtype, device=device) for s, w in zip(shapes, want))
        got = fn(*args, out, backend=backend)
        assert got[0] is out[0] and got[1] is out[1]
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


def test_compiles_for_sm90(compile_check):
    compile_check("draft")
