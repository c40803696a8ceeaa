"""Logprobs: the sampled token's log-probability and the top alternatives, from the very logits
the engine samples from, carried to the gateway in TokenChunks."""

import math
import time

import pytest
import torch

from shared.control import wire
from shared.control.messages import (
    GenerateTask,
    PrefillResult,
    PromptLogprobs,
    SamplingParams,
    TokenChunk,
)
from shared.control.messages import TokenLogprob as TL
from shared.engine.sampler import LOWEST_LOGPROB, logprob_of, sample
from shared.engine.sequence import Sequence
from tests.unit.test_engine import capture_logits, make_engine, run_to_end


def test_logprob_of_is_the_raw_log_softmax_and_its_top_k():
    logits = torch.tensor([1.0, 3.0, -2.0, 2.5, 0.0])
    expected = torch.log_softmax(logits, dim=-1)
    found = logprob_of(logits, 2, top=3)
    assert found.logprob == pytest.approx(float(expected[2]), abs=1e-6)
    assert found.top_ids == [1, 3, 0]
    assert found.top_logprobs == pytest.approx(expected[[1, 3, 0]].tolist(), abs=1e-6)
    assert logprob_of(logits, 2, top=0).top_ids == []


def test_a_probability_of_zero_is_reported_as_the_lowest_finite_logprob():
    logits = torch.tensor([0.0, float("-inf"), 1.0])
    found = logprob_of(logits, 1, top=3)
    assert found.logprob == LOWEST_LOGPROB
    assert all(math.isfinite(v) for v in found.top_logprobs)
    assert found.top_ids[-1] == 1


def test_temperature_does_not_change_the_reported_logprob():
    """OpenAI's API reports the model's distribution, not the sampling one."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.7, top_k=5, seed=11)
    token = sample(logits, params, 0)
    assert logprob_of(logits, token, 2).logprob == pytest.approx(
        float(torch.log_softmax(logits, -1)[token]), abs=1e-6
    )


def make_seq(prompt, max_tokens, **sampling) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    task = GenerateTask("r", list(prompt), params, "reply", time.time())
    return Sequence.from_task(task, None, set(), 512)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_engine_reports_each_tokens_logprob_from_the_logits_it_sampled(
    tiny_model, rand_tokens, temperature
):
    engine = make_engine(tiny_model)
    seq = make_seq(rand_tokens(40), 6, temperature=temperature, seed=5, logprobs=True)
    seq.sampling.top_logprobs = 4
    captured = capture_logits(engine, seq)
    engine.add(seq)
    outputs = []
    while engine.has_work():
        outputs += [out for s, out in engine.step() or [] if s is seq]
    assert [len(o.logprobs) for o in outputs] == [1] * 6
    for out, logits, token in zip(outputs, captured, seq.output_ids):
        expected = torch.log_softmax(logits.float(), -1)
        (lp,) = out.logprobs
        assert lp.logprob == pytest.approx(float(expected[token]), abs=1e-5)
        assert lp.top_ids == torch.topk(expected, 4).indices.tolist()
        if temperature == 0:
            assert lp.top_ids[0] == token  # greedy takes the most likely


def test_without_logprobs_asked_none_are_computed(tiny_model, rand_tokens):
    engine = make_engine(tiny_model)
    seq = make_seq(rand_tokens(20), 3)
    engine.add(seq)
    outputs = []
    while engine.has_work():
        outputs += [out for _, out in engine.step() or []]
    assert outputs and all(out.logprobs == [] for out in outputs)


def test_a_remote_first_token_carries_the_prefill_workers_logprob(tiny_model, rand_tokens):
    """The first token of a disaggregated request is sampled (and scored) by the prefill worker:
    the decode worker emits the logprob it was handed."""
    engine = make_engine(tiny_model)
    seq = make_seq(rand_tokens(20), 1, logprobs=True)
    seq.first_tokens, seq.first_logprobs = [7], [TL(-1.25, [7], [-1.25])]
    assert engine.admit(seq)
    ((_, out),) = engine.kv_arrived(seq)  # landed at once: the batch has room
    assert out.token_ids == [7] and out.logprobs == [TL(-1.25, [7], [-1.25])]
    run_to_end(engine)


def test_logprobs_cross_the_wire():
    chunk = TokenChunk("a", 0, [5, 6], "xy", [TL(-0.5, [5, 2], [-0.5, -1.0]), TL(-2.0)])
    assert wire.decode(wire.encode(chunk), TokenChunk) == chunk
    result = PrefillResult("a", 1, first_tokens=[5], first_logprobs=[TL(-0.5)])
    assert wire.decode(wire.encode(result), PrefillResult).first_logprobs == [TL(-0.5)]


@pytest.mark.parametrize(
    "bad",
    [
        TL(-0.5, [1, 2], [-0.5]),  # lengths differ
        TL(-0.5, list(range(21)), [-1.0] * 21),  # over OpenAI's 20
        TL(-0.5, [1], [float("nan")]),
        TL(float("-inf")),
    ],
)
def test_malformed_logprobs_are_refused_on_receipt(bad):
    with pytest.raises(wire.MessageError):
        wire.decode(wire.encode(TokenChunk("a", 0, [1], "x", [bad])), TokenChunk)


def test_top_logprobs_beyond_twenty_is_out_of_range():
    task = GenerateTask("a", [1], SamplingParams(logprobs=True, top_logprobs=21), "r", 0.0)
    with pytest.raises(wire.MessageError, match="sampling"):
        wire.decode(wire.encode(task), GenerateTask)


@pytest.mark.parametrize(
    "bad",
    [
        PromptLogprobs(1, [-0.5, -1.0], [3], [-0.5]),  # two rows, one alternative
        PromptLogprobs(21, [-0.5], list(range(21)), [-1.0] * 21),  # over OpenAI's 20
        PromptLogprobs(0, [float("nan")]),
        PromptLogprobs(20, [-0.5] * 3000, [1] * 60000, [-1.0] * 60000),  # more than one message
    ],
)
def test_malformed_prompt_logprobs_are_refused_on_receipt(bad):
    result = PrefillResult("a", 1, first_tokens=[5], prompt_logprobs=bad)
    with pytest.raises(wire.MessageError, match="prompt logprobs"):
        wire.decode(wire.encode(result), PrefillResult)
    fine = PromptLogprobs(1, [-0.5, -1.0], [3, 4], [-0.5, -0.25])
    result = PrefillResult("a", 1, first_tokens=[5], prompt_logprobs=fine)
    assert wire.decode(wire.encode(result), PrefillResult).prompt_logprobs == fine
