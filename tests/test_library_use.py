"""The engine embedded as a library: a bad argument to a public call is one clear error (never a
silently shorter batch, an ignored row or a torch error), and registering a method for a while
leaves the tables as they were once it is unregistered."""
from __future__ import annotations

import typing
from dataclasses import dataclass

import pytest
import torch

import psd_kernels
from engine import DecodeConfig, Decoder, InputError, Method, Option, generate, register, unregister
from engine.cost import CostModel
from engine.live import LiveBatch
from engine.methods import METHODS
from engine.options import OPTIONS, POLICY_NAMES
from engine.policies import Confidence
from models import ModelConfig, init_random

PROMPTS = [[5, 6, 7], [8, 9]]


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62)
    return init_random(cfg, seed=3, std=0.5)


@pytest.fixture
def dec(model):
    return Decoder(model, DecodeConfig(gen_length=8, block_length=8))


@pytest.mark.parametrize("lengths, message", [
    ([8], "1 gen lengths for 2 prompts"),                  # was: the second prompt silently dropped
    ([8, 8, 8], "3 gen lengths for 2 prompts"),
    ([0, 8], "gen length 0 must be a positive integer"),   # was: accepted, an empty generation
    ([-8, 8], "gen length -8 must be a positive integer"),  # was: a torch RuntimeError
    ([True, 8], "gen length True must be a positive integer"),
    ([8.0, 8], "gen length 8.0 must be a positive integer"),
    ([5, 8], "gen length 5 is not a multiple of the block length 8"),   # as LiveBatch.add refuses it
    (8, "gen_lengths must be a list"),
])
def test_start_and_join_check_each_gen_length(dec, lengths, message):
    with pytest.raises(InputError, match=message):
        dec.start(PROMPTS, gen_lengths=lengths)
    state = dec.start([[1, 2]], live=True)
    with pytest.raises(InputError, match=message):
        dec.join(state, PROMPTS, lengths)
    assert state.batch.x.shape[0] == 1


def test_start_names_the_prompt_at_fault_with_gen_lengths(dec):
    with pytest.raises(InputError, match="prompt 1 holds a token id outside the vocabulary"):
        dec.start([[1], [99]], gen_lengths=[8, 8])


@pytest.mark.parametrize("rows", [[2], [-1], ["0"], [True]], ids=str)
def test_leave_and_results_refuse_rows_the_batch_does_not_have(dec, rows):
    state = dec.start(PROMPTS)
    dec.step(state)                          # inside the open block
    with pytest.raises(InputError, match="row"):
        dec.leave(state, rows)               # was: silently ignored (-1: not the last row)
    with pytest.raises(InputError, match="row"):
        dec.results(state, rows=rows)
    while not state.done:
        dec.step(state)
    assert [r.token_ids for r in dec.results(state)] == [r.token_ids for r in dec.generate(PROMPTS)]
    dec.leave(state, [0, 1])
    with pytest.raises(InputError, match="it has none left"):
        dec.leave(state, [0])


@pytest.mark.parametrize("handle", [2, -1, True, "0", None, 1.0], ids=repr)
def test_cancel_refuses_a_handle_the_batch_never_gave_out(dec, handle):
    """LiveBatch.cancel of a handle `add` never returned was silently nothing (a typo'd handle left
    its sequence decoding); a finished one is still a quiet no-op (a client can go away after its
    answer)."""
    live = LiveBatch(dec)
    a, b = live.add([5, 6, 7]), live.add([8, 9])
    with pytest.raises(InputError, match="is not a handle this batch gave out"):
        live.cancel(handle)
    done = {}
    while not live.idle:
        done.update(live.step().done)
    assert set(done) == {a, b}
    live.cancel(a)                                  # finished: nothing to do
    live.cancel(torch.tensor(b).item())
    assert live.idle and [done[a].token_ids, done[b].token_ids] == [r.token_ids for r in dec.generate(PROMPTS)]


def test_a_config_that_is_not_a_decodeconfig_is_an_input_error(model):
    with pytest.raises(InputError, match="config must be an engine.DecodeConfig"):
        generate(model, PROMPTS, "confidence")
    with pytest.raises(InputError, match="config must be an engine.DecodeConfig"):
        Decoder(model, {"method": "greedy"})


def test_a_cost_model_needs_one_time_per_canvas_count():
    with pytest.raises(InputError, match="one ms per canvas count"):
        CostModel([1, 2, 4], [1.0, 2.0])     # was: the last point silently dropped
    assert CostModel((n for n in (1, 2)), [1.0, 2.0]).ms(2) == 2.0


@pytest.mark.parametrize("temperature", [-1.0, float("nan"), float("inf"), "1"], ids=str)
def test_top1_refuses_a_temperature_it_cannot_sample_at(temperature):
    logits = torch.randn(2, 16)
    with pytest.raises(ValueError, match="temperature must be a (finite|real) number"):
        psd_kernels.top1(logits, temperature=temperature, noise=torch.rand(2, 16))   # -1 was greedy, silently


# ------------------------------------------------------------------ register / unregister leave no trace
@dataclass(frozen=True)
class Share(Confidence):
    share: float = 0.5
    name = "share"
    params = {**Confidence.params, "share": "share"}
    declares = (Option("share", float, "a toy parameter"),)


@dataclass(frozen=True)
class AnyThreshold(Confidence):
    name = "anythreshold"
    declares = (Option("threshold", float, "any threshold at all"),)


@dataclass(frozen=True)
class Broken(Confidence):
    name = "broken"
    params = {**Confidence.params, "nowhere": "nowhere"}
    declares = (Option("orphan", float, "declared, but the policy also names an option nobody declares"),)


def _tables():
    return dict(METHODS), dict(OPTIONS), list(POLICY_NAMES), dict(typing.get_type_hints(DecodeConfig))


def test_unregister_takes_the_options_its_policy_declared():
    before = _tables()
    register(Method("share", "toy", Share, is_policy=True))
    assert DecodeConfig("share", share=0.25).validate().policy().share == 0.25
    unregister("share")
    assert _tables() == before                         # was: `share` stayed an option and a DecodeConfig field
    with pytest.raises(InputError, match="unknown decoding option 'share'"):
        DecodeConfig(share=0.25)


def test_an_option_another_method_still_takes_stays_until_that_one_goes():
    before = _tables()
    register(Method("share", "toy", Share, is_policy=True))
    register(Method("share2", "the same policy again", Share))
    unregister("share")
    assert "share" in OPTIONS and DecodeConfig("share2", share=0.5).validate()
    unregister("share2")
    assert _tables() == before


def test_unregister_puts_back_an_option_the_policy_replaced():
    before, threshold = _tables(), OPTIONS["threshold"]
    register(Method("anythreshold", "confidence with any threshold", AnyThreshold, is_policy=True))
    DecodeConfig("confidence", threshold=5.0).validate()          # the replaced option has no range
    unregister("anythreshold")
    assert OPTIONS["threshold"] is threshold and _tables() == before
    with pytest.raises(InputError, match="threshold 5.0 is outside"):     # was: still any threshold
        DecodeConfig("confidence", threshold=5.0).validate()


def test_a_refused_registration_leaves_the_tables_as_they_were():
    before = _tables()
    with pytest.raises(ValueError, match="maps the option 'nowhere' to 'nowhere', which is not one of its fields"):
        register(Method("broken", "names an option nobody declares", Broken))
    assert _tables() == before                         # was: `orphan` registered all the same
    with pytest.raises(TypeError, match="register takes an engine.Method"):
        register("broken")


def test_an_embedders_wrong_arguments_are_typed_one_line_errors(model, tmp_path):
    """What an embedder gets wrong: a path or None for the model, a float batch size, per-sequence
    seeds of the wrong type or range (they were wrapped mod 2**64, 2**70 decoding as seed 0, or failed in a
    later step shared with other sequences), a torch dtype or device the loader cannot use (torch's own
    assertion, parse and NotImplemented errors), a model directory that is no path."""
    from models import CheckpointError, load_model, save_checkpoint

    with pytest.raises(InputError, match="model must be a loaded model .* got str \\(a path: load it first\\)"):
        generate("models/default", PROMPTS)
    with pytest.raises(InputError, match="model must be a loaded model"):
        Decoder(None, DecodeConfig())
    sampled = Decoder(model, DecodeConfig(gen_length=8, block_length=8, temperature=1.0, sampler="row"))
    with pytest.raises(InputError, match="max_rows must be an integer, got 2.5"):
        LiveBatch(sampled, max_rows=2.5)
    live = LiveBatch(sampled)
    for seed, message in (("x", "a seed must be an integer, got 'x'"), (1.5, "a seed must be an integer"),
                          (-1, "seed must be in \\[0, 2\\*\\*64\\)"), (2 ** 70, "seed must be in")):
        with pytest.raises(InputError, match=message):
            live.add(PROMPTS[0], seed=seed)
        with pytest.raises(InputError, match=message):
            list(sampled.stream(PROMPTS[:1], seeds=[seed]))
    assert live.waiting == []                                          # nothing half-queued
    same = [r.token_ids for r in sampled.generate(PROMPTS[:1])]
    assert [r.token_ids for r in list(sampled.stream(PROMPTS[:1], seeds=[DecodeConfig().seed]))[-1].results] == same
    path = save_checkpoint(model, tmp_path / "m")
    for kwargs, message in ((dict(dtype=torch.int64), "unknown dtype torch.int64"),
                            (dict(device="tpu"), "unknown device 'tpu'"),
                            (dict(device="meta"), "device 'meta' is not supported"),
                            (dict(device="cuda:7"), "device cuda:7 requested but")):
        with pytest.raises(CheckpointError, match=message):
            load_model(path, **kwargs)
    with pytest.raises(CheckpointError, match="the model directory must be a str or a path, got NoneType"):
        load_model(None)
    assert load_model(path, dtype=torch.bfloat16, device="auto").tok_embeddings.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------- found by an embedder (2026-11-28)
def test_numpy_and_tensor_integers_are_gen_lengths_and_options(model):
    """Token ids took numpy ints; gen lengths and int options refused them ('gen length np.int64(16) must be a
    positive integer'). They are stored as Python ints."""
    np = pytest.importorskip("numpy")
    want = generate(model, PROMPTS, DecodeConfig(gen_length=16, block_length=8))
    cfg = DecodeConfig(gen_length=np.int64(16), block_length=torch.tensor(8), threshold=np.float32(0.5))
    assert (type(cfg.gen_length), type(cfg.block_length), type(cfg.threshold)) == (int, int, float)
    dec = Decoder(model, DecodeConfig(gen_length=8, block_length=8))
    state = dec.start(PROMPTS, [np.int64(16), np.int32(16)])
    assert all(type(g) is int for g in state.batch.gen_len.tolist())
    live = LiveBatch(Decoder(model, DecodeConfig(gen_length=16, block_length=8)))
    h = live.add(PROMPTS[0], gen_length=np.int64(16))
    done = {}
    while (u := live.step()) is not None:
        done.update(u.done)
    assert done[h].token_ids == want[0].token_ids
    for bad in (np.bool_(True), np.float64(16), 16.0):
        with pytest.raises(InputError, match="gen length"):
            DecodeConfig(gen_length=bad)


@pytest.mark.parametrize("live", [False, True])
def test_a_batch_every_row_left_steps_and_reports_nothing(model, live):
    """Decoder.leave of every row set state.batch to None, and step/results/leave then raised AttributeError
    ('NoneType' object has no attribute 'cursor'); `while not state.done: step` never ended."""
    dec = Decoder(model, DecodeConfig(gen_length=16, block_length=8, cache="dual"))
    state = dec.start(PROMPTS, live=live)
    dec.step(state)                                   # a block is open
    dec.leave(state, [0, 1], now=True)
    assert state.batch is None and state.done is (not live)
    assert dec.results(state) == [] and not dec.step(state) and state.done is (not live)
    dec.leave(state, [])
    with pytest.raises(InputError, match="row 0"):
        dec.leave(state, [0])
    if live:                                          # a live batch takes rows again
        dec.join(state, [PROMPTS[1]], [16])
        while not state.at_boundary or state.batch.cursor < state.batch.end:
            if not dec.step(state) and state.batch.cursor >= state.batch.end:
                break
        want = generate(model, [PROMPTS[1]], dec.dc)[0]
        assert dec.results(state)[0].token_ids == want.token_ids


def test_a_done_batch_takes_no_join(model):
    """A finished batch accepted a join, stayed done, and reported the row as masks with 0 calls."""
    dec = Decoder(model, DecodeConfig(gen_length=8, block_length=8))
    state = dec.start(PROMPTS)
    while not state.done:
        dec.step(state)
    with pytest.raises(InputError, match="this batch is done"):
        dec.join(state, [PROMPTS[0]], [8])
    assert len(dec.results(state)) == 2


def test_a_model_on_the_meta_device_is_refused_by_the_decoder(model):
    with torch.device("meta"):
        meta = init_random(model.config, seed=0)
    assert meta.device.type == "meta"
    with pytest.raises(InputError, match="meta device"):
        Decoder(meta, DecodeConfig(gen_length=8, block_length=8))


@pytest.mark.parametrize("cache", ["prefix", "dual", "none"])
def test_threads_sharing_a_decoder_each_decode_as_alone(model, cache):
    """A thread pool's generate() calls on one Decoder with a KV cache failed with IndexError / bad shapes from
    inside the store (one batch's end freed it while another wrote); now they take turns."""
    import threading
    cfg = DecodeConfig(method="confidence", gen_length=16, block_length=8, cache=cache, threshold=0.5)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    want = [generate(model, [p], cfg)[0].token_ids for p in prompts]
    dec, got, errors = Decoder(model, cfg), {}, []

    def work(k):
        try:
            for rep in range(3):
                i = (k + rep) % len(prompts)
                got[(k, rep)] = (i, dec.generate([prompts[i]])[0].token_ids)
        except Exception as e:        # noqa: BLE001 -- reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 12 and all(tokens == want[i] for i, tokens in got.values())
