"""sample(): greedy, temperature, top-k, top-p, and draws that depend on (seed, position) only."""

import torch

from shared.control.messages import SamplingParams
from shared.engine.sampler import argmax_rows, greedy_tokens, plain_greedy, sample, step_seed

VOCAB = 512


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))


def draws(params: SamplingParams, scores: torch.Tensor, n: int, start: int = 0) -> list[int]:
    return [sample(scores, params, pos) for pos in range(start, start + n)]


def test_greedy_is_argmax():
    for seed in range(5):
        scores = logits(seed)
        assert sample(scores, SamplingParams(temperature=0.0, seed=seed), 3) == int(scores.argmax())


def test_seeded_sampling_is_deterministic():
    params = SamplingParams(temperature=1.0, seed=1234)
    scores = torch.zeros(VOCAB)  # uniform: every draw is pure chance
    assert draws(params, scores, 50) == draws(params, scores, 50)
    # A position's token does not depend on what was sampled before it (prefill/decode split).
    assert sample(scores, params, 37) == draws(params, scores, 50)[37]


def test_draws_differ_across_positions_and_seeds():
    scores = torch.zeros(VOCAB)
    a = draws(SamplingParams(temperature=1.0, seed=1), scores, 64)
    b = draws(SamplingParams(temperature=1.0, seed=2), scores, 64)
    assert len(set(a)) > 32  # positions are not all one token
    assert sum(x == y for x, y in zip(a, b)) < 8


def test_top_k_1_is_greedy():
    for seed in range(5):
        scores = logits(seed)
        params = SamplingParams(temperature=2.0, top_k=1, seed=seed)
        assert set(draws(params, scores, 20)) == {int(scores.argmax())}


def test_top_k_limits_the_candidates():
    scores = logits(7)
    top = set(torch.topk(scores, 5).indices.tolist())
    got = set(draws(SamplingParams(temperature=5.0, top_k=5, seed=3), scores, 200))
    assert got <= top and len(got) > 1


def test_tiny_top_p_keeps_only_the_top_token():
    scores = logits(11)
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=5)
    assert set(draws(params, scores, 50)) == {int(scores.argmax())}


def test_top_p_keeps_the_nucleus():
    scores = torch.tensor([3.0, 2.0, 1.0, -10.0, -10.0])  # probs ~ .665 .245 .090 ...
    got = set(draws(SamplingParams(temperature=1.0, top_p=0.8, seed=9), scores, 300))
    assert got == {0, 1}


def test_temperature_sharpens_and_flattens():
    scores = torch.tensor([0.0, 1.0])

    def share_of_top(temperature: float) -> float:
        picks = draws(SamplingParams(temperature=temperature, seed=42), scores, 2000)
        return sum(picks) / len(picks)

    assert abs(share_of_top(1.0) - 0.731) < 0.05  # e / (1 + e)
    assert abs(share_of_top(0.5) - 0.881) < 0.05  # e^2 / (1 + e^2)
    assert share_of_top(0.05) > 0.99
    assert abs(share_of_top(100.0) - 0.5) < 0.05


def test_step_seed_stays_within_63_bits():
    for seed in (0, 1, 2**31, 2**63 - 1):
        for position in (0, 1, 8191, 2**40):
            assert 0 <= step_seed(seed, position) < 2**63
    assert step_seed(1, 0) != step_seed(1, 1) != step_seed(2, 1)
    assert sample(
        torch.zeros(VOCAB), SamplingParams(temperature=1.0, seed=2**63 - 1), 10**6
    ) in range(VOCAB)


def test_greedy_rows_in_one_call_pick_what_sample_picks_row_by_row():
    torch.manual_seed(3)
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins either way
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    wanted = [True, False, True, True, False, True]
    picked = greedy_tokens(logits, wanted)
    for row, want in enumerate(wanted):
        assert picked[row] == (sample(logits[row], greedy, 0) if want else -1)
    assert picked[2] == 7
    assert greedy_tokens(logits, [False] * 6) == [-1] * 6
    assert plain_greedy(greedy)
    assert not plain_greedy(SamplingParams(max_tokens=1, temperature=0.0, logprobs=True))
    assert not plain_greedy(SamplingParams(max_tokens=1, temperature=0.0, n=2))
    assert not plain_greedy(SamplingParams(max_tokens=1, temperature=0.7))


def test_argmax_rows_agrees_with_torch_in_every_dtype_and_on_ties():
    torch.manual_seed(5)
    logits = torch.randn(4, 1000)
    logits[1, 10] = logits[1, 500] = 50.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = logits.to(dtype)
        assert argmax_rows(rows) == torch.argmax(rows.float(), dim=-1).tolist()
    assert argmax_rows(logits)[1] == 10
