"""psd_kernels top1: Triton kernel vs reference, reference semantics, backend selection."""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import psd_kernels
from psd_kernels import reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# conf tolerances per score: the kernel sums in a different order than torch (it is the more
# accurate of the two against float64); entropy values reach log V ≈ 12.
TOL = {"prob": dict(rtol=2e-5, atol=1e-6), "margin": dict(rtol=2e-5, atol=1e-6), "entropy": dict(rtol=1e-5, atol=2e-5)}


def _ops():
    return importlib.import_module("psd_kernels.ops.top1")


def gumbel(shape, gen, device="cpu") -> torch.Tensor:
    # -log(E) with E ~ Exp(1) is a standard Gumbel draw and never hits log(0)
    return -torch.empty(shape).exponential_(generator=gen).log().to(device)


def make_logits(shape, dtype, gen, device, scale=3.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def run_both(logits, exclude_id=None, **kw):
    """Triton into NaN / -7 poisoned out buffers, and the reference on the same inputs."""
    batch = logits.shape[:-1]
    ids = torch.full(batch, -7, dtype=torch.int64, device=logits.device)
    conf = torch.full(batch, float("nan"), dtype=torch.float32, device=logits.device)
    got = psd_kernels.top1(logits, exclude_id, (ids, conf), backend="triton", **kw)
    assert got[0] is ids and got[1] is conf
    want = reference.top1(logits.cpu(), exclude_id, **{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kw.items()})
    return got, want


# ------------------------------------------------------------------------------------------
# Triton vs reference
# ------------------------------------------------------------------------------------------
# excluding the only token of V = 1 is rejected (test_bad_inputs)
VOCAB_EXCLUDE = [(V, ex) for V in (1, 3, 47, 1023, 126464) for ex in (False, True) if not (V == 1 and ex)]


@needs_triton
@pytest.mark.parametrize("V, exclude", VOCAB_EXCLUDE)
@pytest.mark.parametrize("score", ["prob", "margin", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sample", [False, True])
def test_matches_reference(V, exclude, score, dtype, sample, device):
    gen = torch.Generator().manual_seed(V * 131 + len(score) * 7 + exclude * 3 + sample)
    shape = (2,) if V > 100_000 else (3, 5)  # big vocab: interpreter time grows with rows·V
    logits = make_logits(shape + (V,), dtype, gen, device)
    exclude_id = None
    if exclude:
        exclude_id = V // 2
        logits[..., exclude_id] = logits.max() + 5  # would win if it were not excluded
    kw = dict(score=score)
    if sample:
        kw.update(temperature=0.7, noise=gumbel(shape + (V,), gen, device))
    (ids, conf), (ids_ref, conf_ref) = run_both(logits, exclude_id, **kw)
    assert ids.shape == shape and conf.shape == shape
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(conf.cpu(), conf_ref, **TOL[score])
    if exclude_id is not None:
        assert not (ids == exclude_id).any()


@needs_triton
@pytest.mark.parametrize("score", ["prob", "margin", "entropy"])
@pytest.mark.parametrize("sample", [None, "gumbel", "integer"])
def test_many_chunks_with_ties_and_neg_inf(score, sample, device, monkeypatch):
    """Small chunks force the online max/sum/argmax merges across chunk boundaries.
    Integer logits (and integer noise) make exact ties common, also between chunks."""
    monkeypatch.setattr(_ops(), "MAX_BLOCK_V", 128)
    gen = torch.Generator().manual_seed(11 + len(sample or ""))
    V = 1000  # 8 chunks, the last one partial
    logits = torch.randint(-4, 5, (6, V), generator=gen).float()  # integers: many exact ties
    logits[0, :256] = float("-inf")  # whole leading chunks -inf: the running max starts at -inf
    logits[1, 130] = logits[1, 900] = 50.0  # tied maximum in two different chunks -> 130
    logits[2, 5] = logits[2, 6] = 50.0  # tied maximum inside one chunk -> 5
    logits[3, 999] = 60.0  # maximum in the last, partial chunk
    logits[4, ::3] = float("-inf")
    logits = logits.to(device)
    kw = dict(score=score)
    if sample == "gumbel":
        kw.update(temperature=1.3, noise=gumbel((6, V), gen, device))
    elif sample == "integer":
        kw.update(temperature=1.0, noise=torch.randint(-1, 2, (6, V), generator=gen).float().to(device))
    (ids, conf), (ids_ref, conf_ref) = run_both(logits, 17, **kw)
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(conf.cpu(), conf_ref, **TOL[score])
    if sample is None:
        assert ids[1].item() == 130 and ids[2].item() == 5 and ids[3].item() == 999


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_strided_inputs_and_outputs(dtype, device):
    gen = torch.Generator().manual_seed(5)
    V = 301
    logits = make_logits((V, 4, 3), dtype, gen, device).permute(1, 2, 0)  # [4, 3, V], stride(-1) != 1
    noise = gumbel((V, 4, 3), gen, device).permute(1, 2, 0)
    ids = torch.full((4, 3, 2), -7, dtype=torch.int64, device=device)[..., 0]  # non-contiguous out
    conf = torch.full((3, 4), float("nan"), device=device).t()
    for kw in (dict(), dict(temperature=0.5, noise=noise)):
        got = psd_kernels.top1(logits, None, (ids, conf), backend="triton", **kw)
        want = reference.top1(logits.cpu(), None, **{k: v.cpu() if torch.is_tensor(v) else v for k, v in kw.items()})
        assert got[0] is ids
        assert torch.equal(ids.cpu(), want[0])
        torch.testing.assert_close(conf.cpu(), want[1], **TOL["prob"])


@needs_triton
def test_one_dim_logits_and_empty_batch(device):
    gen = torch.Generator().manual_seed(9)
    x = make_logits((50,), torch.float32, gen, device)
    ids, conf = psd_kernels.top1(x, backend="triton")
    assert ids.shape == () and ids.item() == torch.argmax(x).item()
    torch.testing.assert_close(conf.cpu(), torch.softmax(x.cpu(), -1).max())
    ids, conf = psd_kernels.top1(torch.randn(0, 7, 50, device=device), backend="triton")
    assert ids.shape == (0, 7) and conf.shape == (0, 7)


@pytest.mark.gpu
def test_int64_row_offsets():
    """N·V beyond 2^31 elements: the rows past the 32-bit boundary must still be right."""
    V = 126464
    N = (2**31) // V + 64
    logits = torch.empty(N, V, dtype=torch.bfloat16, device="cuda").normal_()
    ids, conf = psd_kernels.top1(logits, backend="triton")
    tail = logits[-64:].cpu()
    ids_ref, conf_ref = reference.top1(tail)
    assert torch.equal(ids[-64:].cpu(), ids_ref)
    torch.testing.assert_close(conf[-64:].cpu(), conf_ref, **TOL["prob"])


# ------------------------------------------------------------------------------------------
# reference semantics
# ------------------------------------------------------------------------------------------
def test_reference_prob_is_naive_softmax_max():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 33, generator=gen) * 4
    ids, conf = reference.top1(x)
    for r in range(4):
        row = [float(v) for v in x[r]]
        z = sum(math.exp(v) for v in row)
        best = max(range(33), key=lambda i: (row[i], -i))
        assert ids[r].item() == best
        assert conf[r].item() == pytest.approx(math.exp(row[best]) / z, rel=1e-5)


def test_reference_margin_and_entropy_naive():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 20, generator=gen, dtype=torch.float64) * 2
    _, margin = reference.top1(x, score="margin")
    _, negent = reference.top1(x, score="entropy")
    assert margin.dtype == torch.float64  # float64 logits stay float64
    for r in range(3):
        z = sum(math.exp(v) for v in x[r].tolist())
        p = sorted((math.exp(v) / z for v in x[r].tolist()), reverse=True)
        assert margin[r].item() == pytest.approx(p[0] - p[1], rel=1e-12)
        assert negent[r].item() == pytest.approx(sum(q * math.log(q) for q in p), rel=1e-12)


def test_reference_exclude_and_ties():
    x = torch.tensor([[1.0, 9.0, 3.0, 3.0], [2.0, 2.0, 2.0, 9.0]])
    ids, conf = reference.top1(x, exclude_id=1)
    assert ids.tolist() == [2, 3]  # first index among the tied 3.0s; the excluded 9.0 never wins
    p = torch.softmax(torch.tensor([1.0, 3.0, 3.0]), -1)
    assert conf[0].item() == pytest.approx(p[1].item(), rel=1e-6)
    _, margin = reference.top1(x, exclude_id=1, score="margin")
    assert margin[0].item() == pytest.approx(0.0, abs=1e-7)  # tied top-2 -> zero margin


def test_reference_gumbel_sampling_follows_tempered_softmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 5.0])
    T, n = 2.0, 40000
    x = logits.expand(n, 5)
    ids, conf = reference.top1(x, exclude_id=4, temperature=T, noise=gumbel((n, 5), gen))
    freq = torch.bincount(ids, minlength=5).float() / n
    kept = logits.clone()
    kept[4] = float("-inf")
    torch.testing.assert_close(freq, torch.softmax(kept / T, -1), atol=0.012, rtol=0)
    # the confidence is the untempered probability of the sampled token
    torch.testing.assert_close(conf, torch.softmax(kept, -1)[ids])


def _textbook_top1(logits, exclude_id=None, *, score="prob", temperature=0.0, noise=None):
    """The formulation the torch path used before it was reorganised: cast, clone, log-softmax
    into a new tensor, argmax, gather / exp."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(acc)
    if exclude_id is not None:
        x = x.clone()
        x[..., exclude_id] = float("-inf")
    logp = torch.log_softmax(x, dim=-1)
    ids = torch.argmax(x / temperature + noise.to(acc), dim=-1) if temperature > 0 else torch.argmax(x, dim=-1)
    if score == "prob":
        conf = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1).exp()
    elif score == "margin":
        top2 = torch.topk(logp.exp(), min(2, x.shape[-1]), dim=-1).values
        conf = top2[..., 0] - (top2[..., 1] if top2.shape[-1] > 1 else 0.0)
    else:
        p = logp.exp()
        conf = torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return ids, conf.to(torch.float32) if acc == torch.float32 else conf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("score", ["prob", "margin", "entropy"])
def test_reference_is_bit_identical_to_the_textbook_formulation(dtype, score):
    """The torch path's fewer passes do the same arithmetic: the engine's tokens and every
    confidence comparison are unchanged (exactness tests compare tokens)."""
    gen = torch.Generator().manual_seed(hash((str(dtype), score)) % 1000)
    for shape in ((3, 5, 1000), (7, 2), (4, 1), (0, 9), (2, 32000)):
        x = make_logits(shape, dtype, gen, "cpu")
        if shape[-1] > 1:
            x[..., 0] = x[..., 1]                        # ties
        for exclude in (None, 1 if shape[-1] > 1 else None):
            for T in (0.0, 0.7):
                noise = gumbel(shape, gen).double() if T else None
                got = reference.top1(x, exclude, score=score, temperature=T, noise=noise)
                want = _textbook_top1(x, exclude, score=score, temperature=T, noise=noise)
                assert torch.equal(got[0], want[0]) and got[1].dtype == want[1].dtype
                assert torch.equal(got[1], want[1]), (shape, exclude, T)


def test_reference_writes_one_logits_sized_tensor():
    """Greedy top-1 (the engine's every call) creates one float copy of the logits, not three."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Big(TorchDispatchMode):
        """Tensors of the logits' size that ops create (an out= or in-place op returns its argument)."""

        def __init__(self):
            super().__init__()
            self.created = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not t._is_view() and t.numel() >= 64 * 500 \
                        and not any(t is a for a in given):
                    self.created += 1
            return out

    for dtype in (torch.bfloat16, torch.float32):
        x = make_logits((64, 500), dtype, torch.Generator().manual_seed(0), "cpu")
        with Big() as big:
            reference.top1(x, 3)
        assert big.created == 1, dtype
        with Big() as big:
            _textbook_top1(x, 3)
        assert big.created == (3 if dtype == torch.bfloat16 else 2)    # cast, clone, log-softmax: the check can fail


# ------------------------------------------------------------------------------------------
# input checks and backend selection
# ------------------------------------------------------------------------------------------
BACKENDS = ["reference"] + (["triton"] if HAS_TRITON else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda f: f(torch.randn(2, 5), score="bogus"), "unknown confidence score"),
        (lambda f: f(torch.randn(2, 5), exclude_id=5), "outside vocabulary"),
        (lambda f: f(torch.randn(2, 1), exclude_id=0), "only token"),
        (lambda f: f(torch.randn(2, 5), temperature=1.0), "needs Gumbel noise"),
        (lambda f: f(torch.randn(2, 5), temperature=1.0, noise=torch.randn(2, 4)), "needs Gumbel noise"),
        (lambda f: f(torch.randint(0, 3, (2, 5))), "floating-point"),
        (lambda f: f(torch.randn(2, 0)), "V >= 1"),
        # a bool id or a float was taken as an int by one backend and refused or misread by the other
        (lambda f: f(torch.randn(2, 5), exclude_id=True), "exclude_id must be an integer token id, got bool"),
        (lambda f: f(torch.randn(2, 5), exclude_id=2.0), "exclude_id must be an integer token id, got float"),
        (lambda f: f(torch.randn(2, 5), temperature="1"), "temperature must be a real number, got str"),
        (lambda f: f(torch.randn(2, 5), temperature=1.0, noise=[[0.0] * 5] * 2), "a tensor with the logits' shape"),
    ],
)
def test_bad_inputs(backend, call, match, device):
    def f(x, **kw):
        if isinstance(kw.get("noise"), torch.Tensor):
            kw["noise"] = kw["noise"].to(device)
        return psd_kernels.top1(x.to(device), backend=backend, **kw)

    with pytest.raises(ValueError, match=match):
        call(f)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_and_0d_tensor_numbers_are_numbers(backend, device):
    """exclude_id and temperature as numpy or 0-d tensor numbers give what Python's give (a numpy
    temperature was refused as not 'a finite number >= 0')."""
    import numpy as np

    x, noise = torch.randn(3, 40, device=device), torch.rand(3, 40, device=device)
    want = psd_kernels.top1(x, 7, temperature=0.5, noise=noise, backend=backend)
    for ex, temp in ((np.int64(7), np.float32(0.5)), (torch.tensor(7), torch.tensor(0.5))):
        got = psd_kernels.top1(x, ex, temperature=temp, noise=noise, backend=backend)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_triton
def test_triton_refuses_meta_tensors_even_interpreted():
    with pytest.raises(ValueError, match="meta tensors"):
        psd_kernels.top1(torch.empty(2, 10, device="meta"), backend="triton")


@needs_triton
def test_triton_rejects_float64_and_bad_out(device):
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        _ops().top1(torch.randn(2, 5, dtype=torch.float64, device=device))
    bad = (torch.empty(2, dtype=torch.int32, device=device), torch.empty(2, device=device))
    with pytest.raises(ValueError, match="out buffer ids"):
        psd_kernels.top1(torch.randn(2, 5, device=device), None, bad, backend="triton")


def _error(fn, *args, **kw) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args, **kw)
    return str(e.value)


def _bad_top1_outs(device):
    """(logits, out, what the ValueError says) for out buffers that top1 must refuse."""
    x, x64 = torch.randn(2, 5, device=device), torch.randn(2, 5, dtype=torch.float64, device=device)
    ids, conf = torch.empty(2, dtype=torch.int64, device=device), torch.empty(2, device=device)
    return [
        (x, (ids.int(), conf), "out buffer ids must be torch.int64 \\(2,\\)"),
        (x, (ids, conf.double()), "out buffer conf must be torch.float32 \\(2,\\)"),
        (x, (ids, conf[:1]), "out buffer conf"),
        (x, (ids[None], conf), "out buffer ids"),
        (x, ([0, 0], conf), "out buffer ids must be a tensor"),
        (x, (ids, torch.empty(2, device="meta")), "out buffer conf .* on meta"),
        (x, ids, "out must be a pair \\(ids, conf\\)"),
        (x, (ids, conf, conf), "out must be a pair"),
        (x64, (ids, conf), "out buffer conf must be torch.float64"),    # float64 logits give float64 conf
    ]


@pytest.mark.parametrize("case", range(9))
def test_bad_out_buffers_fail_alike_on_both_backends(case, device):
    """The reference checks out= as the Triton launcher does (it accepted e.g. an int32 ids buffer):
    the same ValueError, message included, on both backends, before any work."""
    logits, out, match = _bad_top1_outs(device)[case]
    said = {b: _error(psd_kernels.top1, logits, None, out, backend=b) for b in BACKENDS}
    assert re.search(match, said["reference"]), said
    assert len(set(said.values())) == 1, said


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_out_buffers_receive_the_results(backend, dtype, device):
    x = make_logits((2, 3, 40), dtype, torch.Generator().manual_seed(6), device)
    ids = torch.full((2, 3), -7, dtype=torch.int64, device=device)
    conf = torch.full((2, 3), float("nan"), dtype=dtype, device=device)
    got = psd_kernels.top1(x, 1, [ids, conf], backend=backend)
    assert got[0] is ids and got[1] is conf
    want = reference.top1(x, 1)
    assert torch.equal(ids, want[0])
    torch.testing.assert_close(conf, want[1], **TOL["prob"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score", ["prob", "margin", "entropy"])
@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("exclude_id", [None, 0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_row_with_no_token_to_choose(backend, score, sample, exclude_id, dtype, device, monkeypatch):
    """The contract for a row where no token can be chosen (every logit -inf once exclude_id is;
    sampling: every logit / T + noise -inf): conf -inf whatever the score, below every confidence
    (the engine fails a row whose confidence is not finite, as it does for NaN/Inf model output),
    and id 0, or 1 when 0 is the excluded id: never the excluded id. Both backends alike (they gave
    inf/NaN/0 confidences, and the excluded id 0)."""
    if backend == "triton":
        monkeypatch.setattr(_ops(), "MAX_BLOCK_V", 128)       # three chunks, all -inf in the first rows
    gen = torch.Generator().manual_seed(21)
    V, inf = 300, float("inf")
    x = make_logits((5, V), dtype, gen, device)
    x[0] = -inf                                  # no finite logit
    x[1] = -inf
    x[1, 0] = 9.0                                # only id 0 is finite: nothing left when it is excluded
    x[2] = -inf
    x[2, 290] = 1.0                              # one finite logit, in the last chunk: an ordinary row
    kw = dict(score=score)
    if sample:
        noise = gumbel((5, V), gen, device)
        noise[3] = -inf                          # finite logits, but nothing a sample can take
        kw.update(temperature=0.8, noise=noise)
    ids, conf = psd_kernels.top1(x, exclude_id, backend=backend, **kw)
    none = torch.tensor([True, exclude_id == 0, False, sample, False], device=device)
    assert torch.equal(conf[none], torch.full_like(conf[none], -inf))
    assert (ids[none] == (1 if exclude_id == 0 else 0)).all()
    # the other rows as ever: the (sampled) argmax with the excluded id never chosen, a finite confidence
    y = x.to(torch.float64 if dtype == torch.float64 else torch.float32, copy=True)   # the math's dtype
    if exclude_id is not None:
        y[:, exclude_id] = -inf
    if sample:
        y = y / 0.8 + noise.to(y.dtype)
    assert torch.equal(ids[~none], y.argmax(-1)[~none])
    assert torch.isfinite(conf[~none]).all()
    if exclude_id is not None:
        assert not (ids == exclude_id).any()


def test_float64_logits_take_the_reference_path(device):
    gen = torch.Generator().manual_seed(4)
    x = make_logits((3, 40), torch.float64, gen, device)
    ids, conf = psd_kernels.top1(x, 2, backend="triton")
    assert conf.dtype == torch.float64
    want = reference.top1(x, 2)     # on x's device: CUDA's float64 softmax differs from the CPU's in the last bit
    assert torch.equal(ids, want[0]) and torch.equal(conf, want[1])


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown psd_kernels backend"):
        psd_kernels.top1(torch.randn(2, 5), backend="cuda")


def test_backend_is_a_function_after_importing_ops():
    if HAS_TRITON:
        importlib.import_module("psd_kernels.ops.top1")
    assert callable(psd_kernels.top1)
    assert torch.equal(psd_kernels.top1(torch.tensor([[0.0, 2.0, 1.0]]), backend="reference")[0], torch.tensor([1]))


def _python(code: str, **env) -> str:
    full_env = {**os.environ, "PYTHONPATH": REPO, **env}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_reference_backend_never_imports_triton():
    """Not even to check out= buffers (the checks it shares with the launchers live in reference.py)."""
    code = (
        "import sys, torch, psd_kernels\n"
        "psd_kernels.top1(torch.randn(3, 9), backend='reference')\n"
        "try:\n"
        "    psd_kernels.top1(torch.randn(3, 9), out=(torch.empty(3, dtype=torch.int32), torch.empty(3)))\n"
        "except ValueError as e:\n"
        "    print(str(e).split(' must')[0])\n"
        "print(psd_kernels.BACKEND, 'triton' in sys.modules)"
    )
    assert _python(code, PSD_KERNELS_BACKEND="reference").splitlines() == ["out buffer ids", "reference False"]


def test_backend_env_override():
    code = "import psd_kernels; print(psd_kernels.BACKEND)"
    assert _python(code, PSD_KERNELS_BACKEND="Triton") == "triton"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO, "PSD_KERNELS_BACKEND": "cuda"}, timeout=120)
    assert res.returncode != 0 and "PSD_KERNELS_BACKEND" in res.stderr


def test_compiles_for_sm90(compile_check):
    compile_check("top1")
