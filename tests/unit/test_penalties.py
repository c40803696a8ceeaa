"""Penalties, logit bias and min_tokens: the math against a plain reference, each sequence's own
counts (batch invariance, forks, resumed output), and the first token a prefill worker draws."""

import math
import time

import pytest
import torch

from shared.control.choices import choice_id
from shared.control.messages import GenerateTask, SamplingParams
from shared.engine.penalties import Penalties, shape
from shared.engine.sampler import plain_greedy
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence
from shared.engine.shaping import shaped
from tests.unit.test_engine import capture_logits, land, make_engine, run_to_end

END = 2  # the end token of these tests' sequences
PENALISED = dict(
    repetition_penalty=1.3,
    frequency_penalty=0.7,
    presence_penalty=0.4,
    bias_token_ids=[5, 9, 40],
    bias_values=[3.0, -100.0, 1.5],
    min_tokens=4,
)


def reference(logits, params: SamplingParams, prompt, resumed: int, output, ends) -> torch.Tensor:
    """vLLM v1's definitions, one token at a time: min_tokens, the bias, then repetition (prompt
    and output), frequency and presence (output: the resumed tokens and this attempt's)."""
    row = logits.double().tolist()
    if len(output) < params.min_tokens and not params.ignore_eos:
        for token in ends:
            row[token] = -math.inf
    for token, value in zip(params.bias_token_ids, params.bias_values):
        row[token] += value
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        row[token] = row[token] / r if row[token] > 0 else row[token] * r
    produced = prompt[len(prompt) - resumed :] + list(output)
    for token in set(produced):
        row[token] -= params.frequency_penalty * produced.count(token)
        row[token] -= params.presence_penalty
    return torch.tensor(row, dtype=torch.float64)


def assert_close(mine: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(mine), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert torch.allclose(mine.double()[finite], expected[finite], atol=1e-4)


def make_seq(prompt, max_tokens=8, ends=(END,), attempt_id="r.abc", **sampling) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    task = GenerateTask(attempt_id, list(prompt), params, "reply", time.time())
    return Sequence.from_task(task, None, set(ends), 512)


def alone(penalties: Penalties, logits, prompt, resumed: int, output) -> torch.Tensor:
    """`logits` [vocab] shaped by `penalties`, in a batch of its own (a copy)."""
    batch = logits[None].clone()
    shape(batch, [(0, penalties.stages(batch[0], prompt, resumed, output))])
    return batch[0]


@pytest.mark.parametrize(
    "sampling, resumed",
    [
        (PENALISED, 0),
        (PENALISED, 5),
        (dict(PENALISED, repetition_penalty=0.7, frequency_penalty=-1.5), 3),
        (dict(presence_penalty=2.0), 4),
        (dict(min_tokens=2, ignore_eos=True), 0),  # no end token to hold back
        (dict(bias_token_ids=[END], bias_values=[100.0], min_tokens=9), 0),
    ],
)
def test_the_shaped_row_is_the_reference_s(sampling, resumed):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, generator=generator) * 4
    prompt = torch.randint(0, 64, (30,), generator=generator).tolist()
    output = [5, 7, 7, 9, 7, 12]
    params = SamplingParams(max_tokens=16, **sampling)
    penalties = Penalties.of(params, {END, 3})
    for i in range(len(output) + 1):  # built at the first draw, then kept up to date
        mine = alone(penalties, logits, prompt, resumed, output[:i])
        assert_close(mine, reference(logits, params, prompt, resumed, output[:i], {END, 3}))
        if i < len(output):
            penalties.add(output[i])
    fresh = alone(Penalties.of(params, {END, 3}), logits, prompt, resumed, output)
    assert torch.equal(fresh, alone(penalties, logits, prompt, resumed, output))


def test_rows_shaped_together_are_each_bit_for_bit_the_row_shaped_alone():
    """Each stage is one op over every row: a row's values depend on its own state only."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 64, generator=generator) * 4
    asks = [
        PENALISED,
        dict(repetition_penalty=0.6),
        dict(frequency_penalty=-1.0, bias_token_ids=[9, 5], bias_values=[7.0, -3.0]),
        PENALISED,  # the same as row 0, other tokens
        dict(min_tokens=1, presence_penalty=1.5),
    ]
    states = []
    for i, asked in enumerate(asks):
        prompt = torch.randint(0, 64, (20 + i,), generator=generator).tolist()
        output = torch.randint(0, 64, (i * 3,), generator=generator).tolist()
        params = SamplingParams(max_tokens=32, **asked)
        states.append((Penalties.of(params, {END}), prompt, i % 2, output))
    rows = [1, 2, 3, 5, 0]  # row 4 asks for nothing
    batch = logits.clone()
    put_back = shape(batch, [(r, p.stages(batch[r], *rest)) for r, (p, *rest) in zip(rows, states)])
    for row, (penalties, *rest) in zip(rows, states):
        assert torch.equal(batch[row], alone(penalties, logits[row], *rest))
    assert torch.equal(batch[4], logits[4])
    put_back()
    assert torch.equal(batch, logits)


def shape_of(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    with shaped(logits[None], [(0, seq)]) as rows:
        return rows[0].clone()


def test_the_row_is_put_back_after_the_draw_and_a_request_without_any_pays_nothing():
    """The runner's logits are as they came once the token is drawn: logprobs read them raw,
    and a runner may keep them (the mock engine's buffer lives on from step to step)."""
    logits = torch.randn(2, 64)
    raw = logits.clone()
    seq, plain = make_seq([5, 6, 7], **PENALISED), make_seq([5, 6, 7], temperature=0.0)
    with shaped(logits, [(0, plain), (1, seq)]) as rows:
        assert rows.logits is logits and torch.equal(logits[0], raw[0])
        assert not torch.equal(logits[1], raw[1])  # in place, for the draw
    assert torch.equal(logits, raw) and plain.penalties is None
    with pytest.raises(TypeError, match="float32"):
        shape_of(seq, raw[0].bfloat16())
    assert plain_greedy(seq.sampling)  # its argmax is taken with the others', once shaped
    assert Penalties.of(SamplingParams(repetition_penalty=1.0, presence_penalty=0.0), {2}) is None


def test_a_token_beyond_the_model_s_rows_is_left_out():
    """A model's rows may be narrower than its tokenizer's vocabulary (the mock engine's are)."""
    params = SamplingParams(
        bias_token_ids=[3, 200], bias_values=[1.0, 5.0], min_tokens=1, frequency_penalty=1.0
    )
    penalties = Penalties.of(params, {END, 500})
    row = alone(penalties, torch.zeros(64), [1, 2, 300], 1, [])
    assert row[3] == 1.0 and row[END] == -math.inf and int(torch.isinf(row).sum()) == 1
    penalties.add(400)
    penalties.add(4)
    assert alone(penalties, torch.zeros(64), [1, 2, 300], 1, [400, 4])[4] == -1.0


def test_the_engine_draws_each_greedy_token_from_the_reference_row(tiny_model, rand_tokens):
    prompt = rand_tokens(40)
    engine = make_engine(tiny_model)
    seq = make_seq(prompt, 12, temperature=0.0, **PENALISED)
    captured = capture_logits(engine, seq)
    engine.add(seq)
    run_to_end(engine)
    assert len(captured) == len(seq.output_ids) > 4  # min_tokens 4: END may come after
    for i, logits in enumerate(captured):
        row = reference(logits, seq.sampling, prompt, 0, seq.output_ids[:i], {END})
        assert seq.output_ids[i] == int(torch.argmax(row))
    unpenalised = make_seq(prompt, 12, temperature=0.0)
    engine.add(unpenalised)
    run_to_end(engine)
    assert unpenalised.output_ids != seq.output_ids  # the penalties changed something


def outputs(model, seqs) -> list[list[int]]:
    engine = make_engine(model)
    for seq in seqs:
        engine.add(seq)
    run_to_end(engine)
    return [seq.output_ids for seq in seqs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sequence_s_tokens_do_not_depend_on_its_neighbours(tiny_model, rand_tokens, temperature):
    prompt = rand_tokens(37)
    mine = dict(PENALISED, temperature=temperature, seed=11)

    def me():
        return make_seq(prompt, 10, attempt_id="me", **mine)

    (alone,) = outputs(tiny_model, [me()])
    neighbours = [
        make_seq(rand_tokens(20), 10, attempt_id="a", frequency_penalty=2.0, temperature=0.0),
        make_seq(rand_tokens(50), 6, attempt_id="b", temperature=0.0),
        make_seq(prompt, 10, attempt_id="c", repetition_penalty=0.5, temperature=1.0, seed=3),
    ]
    assert outputs(tiny_model, [*neighbours, me()])[-1] == alone
    assert outputs(tiny_model, [me(), neighbours[2].fork("d", neighbours[2].sampling, 0)])[0] == (
        alone
    )


def choices(engine, seq) -> dict[str, list[int]]:
    engine.add(seq)
    run_to_end(engine)
    return {s.attempt_id: s.output_ids for s in [seq, *engine.take_forked()]}


def test_each_choice_counts_its_own_tokens(tiny_model, rand_tokens):
    """Forked at its first token, each choice of n = 3 is the request of n = 1 with its seed:
    what one choice draws never penalises another."""
    prompt = rand_tokens(40)
    asked = dict(PENALISED, frequency_penalty=1.5, temperature=1.0)
    forked = choices(make_engine(tiny_model), make_seq(prompt, 10, n=3, seed=7, **asked))
    for index in range(3):
        alone = make_seq(prompt, 10, seed=7 + index, **asked)
        assert forked[choice_id("r.abc", index)] == outputs(tiny_model, [alone])[0]
    assert len({tuple(ids) for ids in forked.values()}) == 3
    tight = make_engine(tiny_model, num_blocks=4)  # no room to share: recomputed, the same
    assert choices(tight, make_seq(prompt, 10, n=3, seed=7, **asked)) == forked


def test_a_fork_copies_the_counts_and_then_goes_its_own_way():
    seq = make_seq([5, 6, 7], frequency_penalty=1.0)
    seq.append(8)
    shape_of(seq, torch.zeros(16))  # built now
    child = seq.fork("r.abc~1", seq.sampling, 1)
    seq.append(8)
    child.append(9)
    assert shape_of(seq, torch.zeros(16))[8:10].tolist() == [-2.0, 0.0]
    assert shape_of(child, torch.zeros(16))[8:10].tolist() == [-1.0, -1.0]


def test_a_resumed_sequence_counts_the_tokens_it_was_sent_as_output(tiny_model):
    """A request moved after k tokens (prompt + those k, resume_tokens = k) goes on with the
    undisturbed run's tokens only because those k count as output, not as prompt."""

    def run(prompt, max_tokens, resume=0):
        seq = make_seq(
            prompt, max_tokens, temperature=0.0, frequency_penalty=1.2, presence_penalty=0.5
        )
        seq.resume_tokens = resume
        return outputs(tiny_model, [seq])[0]

    prompt = list(range(3, 40))
    whole = run(prompt, 14)
    as_prompt = []
    for k in (1, 4, 9):
        assert run(prompt + whole[:k], 14 - k, resume=k) == whole[k:]
        as_prompt.append(run(prompt + whole[:k], 14 - k) == whole[k:])
    assert not all(as_prompt)  # counted as prompt, they are not penalised: other tokens


def test_min_tokens_holds_back_the_end_token_until_reached(tiny_model, rand_tokens):
    forced = dict(bias_token_ids=[END], bias_values=[100.0], temperature=0.0)  # END, if allowed
    prompt = rand_tokens(20)
    (at_once,) = outputs(tiny_model, [make_seq(prompt, 8, **forced)])
    assert at_once == [END]
    held = make_seq(prompt, 8, min_tokens=3, **forced)
    outputs(tiny_model, [held])
    assert held.output_ids[:3].count(END) == 0 and held.output_ids[3] == END
    assert held.status is SeqStatus.FINISHED_STOPPED and len(held.output_ids) == 4


def remote(model, prompt, max_tokens, **sampling) -> dict[str, list[int]]:
    """Disaggregated in one process: a prefill-only engine draws the first token of each choice,
    its KV lands in the decode engine's blocks, and the decode engine draws the rest."""
    prefill = make_engine(model)
    first = make_seq(prompt, max_tokens, attempt_id="r.abc", **sampling)
    first.prefill_only = True
    prefill.add(first)
    ((_, out),) = prefill.step()
    pool = prefill.runner.pool
    buffer = pool.export(pool.slots(first.block_table, 0, first.prompt_len)).clone()
    decode = make_engine(model)
    seq = make_seq(prompt, max_tokens, attempt_id="r.abc", **sampling)
    assert decode.admit(seq)
    land(decode, seq, buffer)
    seq.first_tokens = out.token_ids
    decode.kv_arrived(seq)
    run_to_end(decode)
    return {s.attempt_id: s.output_ids for s in [seq, *decode.take_forked()]}


def test_the_prefill_worker_s_first_token_obeys_the_bias_and_min_tokens(tiny_model, rand_tokens):
    forced = dict(bias_token_ids=[END], bias_values=[100.0], temperature=0.0)
    prompt = rand_tokens(24)
    assert remote(tiny_model, prompt, 4, **forced) == {"r.abc": [END]}
    held = remote(tiny_model, prompt, 4, min_tokens=2, **forced)["r.abc"]
    assert END not in held[:2] and held[2] == END


@pytest.mark.parametrize("n, temperature", [(1, 0.0), (3, 1.0)])
def test_disaggregated_penalised_output_is_the_colocated_output(
    tiny_model, rand_tokens, n, temperature
):
    prompt = rand_tokens(45)
    asked = dict(PENALISED, n=n, temperature=temperature, seed=5)
    colocated = choices(make_engine(tiny_model), make_seq(prompt, 10, **asked))
    assert remote(tiny_model, prompt, 10, **asked) == colocated


def test_logprobs_stay_the_model_s_own(tiny_model, rand_tokens):
    engine = make_engine(tiny_model)
    seq = make_seq(rand_tokens(30), 6, temperature=0.0, logprobs=True, **PENALISED)
    captured = capture_logits(engine, seq)
    engine.add(seq)
    reported = []
    while engine.has_work():
        reported += [lp for s, out in engine.step() or [] if s is seq for lp in out.logprobs]
    for lp, logits, token in zip(reported, captured, seq.output_ids, strict=True):
        assert lp.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)


def test_a_penalised_neighbour_leaves_the_mock_engine_s_answers_alone():
    """The mock runner hands out one buffer step after step: a neighbour's shaping written into
    it would change what the others draw next."""
    from tests.unit.test_mock_engine import engine_of, expected, runner

    mock = runner()
    engine = engine_of(mock)
    plain = make_seq(list(range(10, 40)), 12, temperature=0.0, ignore_eos=True)
    bias = dict(
        bias_token_ids=list(range(10, 500, 7)), bias_values=[100.0] * 70
    )  # to leak if it can
    neighbour = make_seq(list(range(50, 70)), 4, temperature=0.0, attempt_id="n", **bias)
    for seq in (neighbour, plain):  # its row first: the plain one's, once it has finished
        engine.add(seq)
    run_to_end(engine)
    assert plain.output_ids == expected(mock, list(range(10, 40)), 12)


def test_the_runner_s_argmax_is_taken_only_while_no_row_is_penalised_in_place():
    """A runner may name its rows' argmax without reading them (StepRunner.argmax): that is of
    the logits as it gave them, so a step with a penalised row reads the rows instead."""
    logits = torch.randn(2, 64)
    seq, plain = make_seq([5, 6, 7], **PENALISED), make_seq([5, 6, 7], temperature=0.0)
    named = []

    def runner_argmax(rows: torch.Tensor) -> list[int]:
        named.append(rows.shape[0])
        return [3, 4][: rows.shape[0]]

    with shaped(logits, [(0, plain)], argmax=runner_argmax) as rows:
        assert rows.greedy([True]) == [3] and named == [1]
    with shaped(logits, [(0, plain), (1, seq)], argmax=runner_argmax) as rows:
        read = [int(torch.argmax(rows[0])), int(torch.argmax(rows[1]))]
        assert rows.greedy([True, True]) == read and named == [1]
