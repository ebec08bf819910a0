"""psd_kernels draft family: rank_positions, assemble_drafts, commit (Triton vs reference and semantics)."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import psd_kernels
from psd_kernels import reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
BACKENDS = ["reference"] + (["triton"] if HAS_TRITON else [])


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


def test_rank_positions_tie_rule_example():
    conf = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1, 0.99]])
    masked = torch.tensor([[True, True, True, True, True, False]])  # 0.99 is not masked: never ranked
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
    B, L, K = 3, 9, 6
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
# commit
# ------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("L", [1, 7, 32, 100])
@pytest.mark.parametrize("k", [0, 1, 3, "per_row"])
@pytest.mark.parametrize("threshold", [math.inf, 0.5, -math.inf])
def test_commit_matches_reference(L, k, threshold, device):
    gen = torch.Generator().manual_seed(L * 7 + (k if isinstance(k, int) else 99))
    B = 4
    block, masked, pred, conf = make_row_state(B, L, gen, device, tie_levels=5)
    kk = torch.randint(0, L + 1, (B,), generator=gen).to(device) if k == "per_row" else k
    want = reference.commit(block.cpu(), masked.cpu(), pred.cpu(), conf.cpu(), kk.cpu() if torch.is_tensor(kk) else kk,
                            threshold)
    new = torch.full((B, L), -7, dtype=torch.int64, device=device)
    committed = ~want[1].to(device)
    got = psd_kernels.commit(block, masked, pred, conf, kk, threshold, (new, committed), backend="triton")
    assert got[0] is new
    assert torch.equal(new.cpu(), want[0])
    assert torch.equal(committed.cpu(), want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_commit_in_place(backend, device):
    gen = torch.Generator().manual_seed(8)
    block, masked, pred, conf = make_row_state(3, 16, gen, device)
    want = reference.commit(block.cpu(), masked.cpu(), pred.cpu(), conf.cpu(), 2, 0.7)
    committed = torch.empty(3, 16, dtype=torch.bool, device=device)
    got = psd_kernels.commit(block, masked, pred, conf, 2, 0.7, (block, committed), backend=backend)
    assert got[0] is block
    assert torch.equal(block.cpu(), want[0]) and torch.equal(committed.cpu(), want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_commit_policy_semantics(backend, device):
    gen = torch.Generator().manual_seed(10)
    B, L = 5, 12
    block, masked, pred, conf = (t.cpu() for t in make_row_state(B, L, gen, "cpu", tie_levels=6))
    masked[0] = False
    masked[1] = True
    args = [t.to(device) for t in (block, masked, pred, conf)]

    def run(k, threshold):
        new, committed = psd_kernels.commit(*args, k, threshold, backend=backend)
        return new.cpu(), committed.cpu()

    # greedy: exactly the single most confident masked position (lowest index on ties)
    new, committed = run(1, math.inf)
    for b in range(B):
        sigma = naive_order(conf[b].tolist(), masked[b].tolist())
        assert committed[b].nonzero().flatten().tolist() == sigma[:1]
        assert torch.equal(new[b], torch.where(committed[b], pred[b], block[b]))
    # confidence(τ): all masked with c >= τ, or the most confident one if none passes
    tau = 0.6
    new, committed = run(1, tau)
    for b in range(B):
        sigma = naive_order(conf[b].tolist(), masked[b].tolist())
        above = [i for i in sigma if conf[b, i] >= tau]
        assert sorted(committed[b].nonzero().flatten().tolist()) == sorted(above or sigma[:1])
    # topk with a per-row k
    k = torch.tensor([3, 0, 2, 20, 1])
    _, committed = run(k.to(device), math.inf)
    for b in range(B):
        sigma = naive_order(conf[b].tolist(), masked[b].tolist())
        assert sorted(committed[b].nonzero().flatten().tolist()) == sorted(sigma[: k[b]])
    assert not (committed & ~masked).any()  # never an unmasked position


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
    with pytest.raises(ValueError, match="k must be an int or an int64 tensor of shape"):
        psd_kernels.commit(block, masked, pred, conf, torch.ones(3, dtype=torch.int64, device=device), backend=backend)
    with pytest.raises(ValueError, match="k must be an int or an int64 tensor"):
        psd_kernels.commit(block, masked, pred, conf, 1.5, backend=backend)


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


def test_compiles_for_sm90(compile_check):
    compile_check("draft")
