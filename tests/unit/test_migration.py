"""The next attempt of a request whose worker failed: the output sent so far becomes prompt."""

from services.gateway.migration import client_id, resumed
from shared.control.messages import GenerateTask, SamplingParams


def test_a_resumed_attempt_carries_the_sent_tokens_and_what_is_left_to_generate():
    first = GenerateTask(
        attempt_id="req-1.aaaa",
        prompt_token_ids=[5, 6, 7],
        reply_subject="g",
        arrival_time=1.0,
        sampling=SamplingParams(max_tokens=10, stop=["x"]),
        deadline=9.0,
        priority=3,
    )
    second = resumed(first, [5, 6, 7], [20, 21, 22], "d1")
    assert second.prompt_token_ids == [5, 6, 7, 20, 21, 22] and second.resume_tokens == 3
    assert second.sampling.max_tokens == 7 and second.sampling.stop == ["x"]
    assert second.avoid_workers == ["d1"]
    assert client_id(second.attempt_id) == "req-1" and second.attempt_id != first.attempt_id
    assert (second.deadline, second.priority, second.arrival_time) == (9.0, 3, 1.0)
    third = resumed(second, [5, 6, 7], [20, 21, 22, 23], "p2")
    assert third.prompt_token_ids == [5, 6, 7, 20, 21, 22, 23] and third.resume_tokens == 4
    assert third.sampling.max_tokens == 6 and third.avoid_workers == ["d1", "p2"]
    assert (first.moves, second.moves, third.moves) == (
        0,
        1,
        2,
    )  # placed again: it waits ahead of new ones
    # the earlier attempts unchanged
    assert first.sampling.max_tokens == 10 and first.avoid_workers == []


def test_min_tokens_counts_what_was_sent_as_max_tokens_does():
    first = GenerateTask(
        "req-1.aaaa", [5, 6], SamplingParams(max_tokens=10, min_tokens=4), "g", 1.0
    )
    second = resumed(first, [5, 6], [20, 21, 22], "d1")
    assert (second.sampling.max_tokens, second.sampling.min_tokens) == (7, 1)
    third = resumed(second, [5, 6], [20, 21, 22, 23, 24], "d2")  # past min_tokens: none left
    assert (third.sampling.max_tokens, third.sampling.min_tokens) == (5, 0)
    assert first.sampling.min_tokens == 4
