"""An attempt is a value: each transition returns a new one and leaves the old one, and the task it
carries, as they were."""

import copy
import dataclasses

import pytest

from services.gateway.attempt import Attempt, Sent
from services.gateway.migration import client_id
from shared.control.failure import Code, Retry, failed, worker_failed, worker_full
from shared.control.messages import GenerateTask, SamplingParams, TokenChunk

FULL = worker_full("p1", "p1 is full")
FAILED = worker_failed("d1", "d1 stopped responding")


def first_attempt() -> Attempt:
    return Attempt(
        GenerateTask(
            attempt_id="req.aaaa",
            prompt_token_ids=[5, 6, 7],
            sampling=SamplingParams(max_tokens=10),
            reply_subject="g",
            arrival_time=1.0,
        )
    )


def chunk(index: int, token_ids: list[int]) -> TokenChunk:
    return TokenChunk(attempt_id="req.aaaa", index=index, token_ids=token_ids)


def test_an_attempt_placed_counts_the_chunks_and_tokens_it_receives():
    unplaced = first_attempt()
    placed = unplaced.placed("d1")
    serving = placed.received(chunk(0, [20])).received(chunk(1, [21, 22]))
    assert (serving.worker, serving.sent, serving.expected) == ("d1", (20, 21, 22), 2)
    assert (placed.sent, placed.expected) == ((), 0)  # a new attempt each time, as replace's
    assert serving == dataclasses.replace(placed, sent=Sent([20, 21, 22]), expected=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        serving.expected = 5
    assert (unplaced.worker, unplaced.sent, unplaced.expected) == ("", (), 0)
    assert serving.task is unplaced.task and serving.id == "req.aaaa"


def test_an_attempt_takes_only_the_chunk_it_expects_and_is_placed_once():
    serving = first_attempt().placed("d1")
    with pytest.raises(ValueError):
        first_attempt().received(chunk(0, [20]))  # not placed yet
    with pytest.raises(ValueError):
        serving.received(chunk(1, [20]))
    with pytest.raises(ValueError):
        serving.placed("d2")


def test_an_attempt_no_scheduler_placed_is_submitted_again_once_under_a_new_id():
    first = first_attempt()
    again = first.resubmitted()
    assert again.id != first.id and client_id(again.id) == client_id(first.id) == "req"
    assert dataclasses.replace(again.task, attempt_id=first.id) == first.task
    assert again.resubmission and not first.resubmission and again.task.moves == 0
    with pytest.raises(ValueError):
        again.resubmitted()
    with pytest.raises(ValueError):
        first.placed("d1").resubmitted()


def test_a_move_resumes_after_the_tokens_sent_and_counts_its_kind():
    serving = first_attempt().resubmitted().placed("d1").received(chunk(0, [20, 21]))
    moved = serving.moved(FAILED)
    assert (moved.worker, moved.expected, moved.sent) == ("", 0, (20, 21))
    assert moved.task.prompt_token_ids == [5, 6, 7, 20, 21] and moved.task.resume_tokens == 2
    assert moved.task.avoid_workers == ["d1"] and moved.task.sampling.max_tokens == 8
    assert (moved.failed_moves, moved.full_moves, moved.task.moves) == (1, 0, 1)
    assert moved.moved_because == "d1 stopped responding" and not moved.resubmission
    assert client_id(moved.id) == "req" and moved.id not in (serving.id, first_attempt().id)
    again = moved.placed("d2").received(chunk(0, [22])).moved(FULL)
    assert again.prompt == [5, 6, 7] and again.task.prompt_token_ids == [5, 6, 7, 20, 21, 22]
    assert again.task.avoid_workers == ["d1"]  # a full worker is not avoided
    assert (again.moves(Retry.HERE), again.moves(Retry.ELSEWHERE), again.task.moves) == (1, 1, 2)
    with pytest.raises(ValueError):  # a failure of the request itself does not move it
        again.moved(failed(Code.CANCELLED, "client went away"))


def test_no_transition_changes_the_task_it_started_from():
    start = first_attempt()
    before = copy.deepcopy(start.task)
    start.resubmitted().placed("d1").received(chunk(0, [20])).moved(FAILED).moved(FULL)
    start.placed("d1").received(chunk(0, [20])).moved(FULL)
    assert start.task == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        start.worker = "d1"


def test_tokens_sent_are_a_value_each_attempt_reading_its_own():
    serving = first_attempt().placed("d1").received(chunk(0, [20]))
    line = serving.received(chunk(1, [21]))
    branch = serving.received(chunk(1, [30, 31]))  # not the newest of its line: copies first
    assert (serving.sent, line.sent, branch.sent) == ((20,), (20, 21), (20, 30, 31))
    assert line.received(chunk(2, [22])).sent == (20, 21, 22) and branch.sent == (20, 30, 31)
    assert hash(line.sent) == hash((20, 21)) and list(Sent()) == [] and len(line.sent) == 2
    assert first_attempt().sent == () and first_attempt().sent is not first_attempt().sent
