"""A PrefillWorker and a DecodeWorker end to end over the in-memory bus and the in-process data
plane (tiny model): the KV moves, the tokens are those of a local prefill, every block comes back
exactly once on each side, on the normal path and when the request ends mid-transfer."""

import dataclasses
import time

import pytest

from shared.control.choices import choice_id, choice_sampling
from shared.control.failure import Code, failed, worker_failed
from shared.control.messages import CancelRequest
from tests.unit.transfer_fakes import DECODE, PREFILL, Pair, make_task, until


def in_flight(pair: Pair, attempt_id: str) -> bool:
    """Pieces of the request are on the wire (and held there: the decode plane holds them)."""
    t = pair.prefill.ship.held.get(attempt_id)
    return t is not None and bool(t.sender.sends)


@pytest.mark.parametrize("how", ["push", "staged"])
async def test_a_remote_prefill_streams_the_same_tokens_as_a_local_one(tiny_model, how):
    async with Pair(tiny_model, kv_connector=how) as pair:
        assert (await pair.submit(make_task("local", 70, max_tokens=6), remote=False)).ok
        assert (await pair.submit(make_task("remote", 70, max_tokens=6))).ok
        local, remote = await pair.outcome("local"), await pair.outcome("remote")
        assert local.finish_reason == remote.finish_reason == "length"
        assert pair.tokens("remote") == pair.tokens("local") and len(pair.tokens("local")) == 6
        assert remote.timing.path == "disaggregated" and remote.timing.prefill_worker == PREFILL
        assert local.timing.path == "local" and local.timing.prefill_worker == DECODE
        assert [c.index for c in pair.chunks["remote"]] == list(range(len(pair.chunks["remote"])))
        assert pair.prefill_plane.counters.bytes_sent == pair.decode_plane.counters.bytes_received
        await pair.idle()
        assert pair.prefill_freed == {"remote": 1}
        assert pair.decode_freed == {"local": 1, "remote": 1}
        assert pair.prefill.ship.served == 1 and pair.decode.served == 2


async def test_a_cancel_mid_transfer_frees_both_sides_once(tiny_model):
    async with Pair(tiny_model) as pair:
        pair.decode_plane.hold = True  # the KV cannot land: the transfer stays in flight
        assert (await pair.submit(make_task("r", 200))).ok
        await until(lambda: in_flight(pair, "r"))
        await pair.bus.publish(pair.subjects.cancel, CancelRequest(attempt_id="r", reason="bye"))
        pair.decode_plane.hold = False
        last = await pair.outcome("r")
        assert last.finish_reason == "cancelled"
        await pair.idle()
        assert pair.prefill_freed == {"r": 1} and pair.decode_freed == {"r": 1}


async def test_a_deadline_during_the_transfer_is_deadline_exceeded(tiny_model):
    async with Pair(tiny_model) as pair:
        pair.decode_plane.hold = True
        assert (await pair.submit(make_task("r", 200, deadline=time.time() + 0.5))).ok
        last = await pair.outcome("r")
        assert last.failure == failed(Code.DEADLINE_EXCEEDED, "the request's deadline passed")
        pair.decode_plane.hold = False
        await pair.idle()
        assert pair.prefill_freed == {"r": 1} and pair.decode_freed == {"r": 1}


async def test_a_lost_prefill_worker_fails_the_request_for_another_one(tiny_model):
    async with Pair(tiny_model) as pair:
        pair.decode_plane.hold = True
        pair.liveness.gone.add(PREFILL)
        assert (await pair.submit(make_task("r", 200))).ok
        last = await pair.outcome("r")
        assert last.failure == worker_failed(
            PREFILL, f"prefill worker {PREFILL} stopped responding"
        )
        assert (last.failure.code, last.failure.movable, last.failure.avoid) == (
            Code.UNAVAILABLE,
            True,
            PREFILL,
        )
        pair.decode_plane.hold = False
        pair.liveness.gone.clear()
        await pair.idle()
        assert pair.decode_freed == {"r": 1} and pair.prefill_freed.get("r", 0) <= 1


async def _choices(pair: Pair, task) -> dict[str, list]:
    """Each choice's chunks (by attempt id), once every choice has its last."""
    ids = [choice_id(task.attempt_id, i) for i in range(task.sampling.n)]

    def by_choice() -> dict[str, list]:
        return {i: [c for c in pair.chunks[task.attempt_id] if c.attempt_id == i] for i in ids}

    await until(
        lambda: all(c and (c[-1].finish_reason or c[-1].failure) for c in by_choice().values())
    )
    return by_choice()


@pytest.mark.parametrize("remote", [True, False])
async def test_n_choices_stream_on_their_own_ids_from_one_prefill(tiny_model, remote):
    """Three choices, each what a request of n = 1 with its seed streams; the prompt prefilled
    once (on the prefill worker, or here); every block back once the choices end."""
    async with Pair(tiny_model) as pair:
        task = make_task("g", 70, max_tokens=5)
        task.sampling = dataclasses.replace(task.sampling, n=3, temperature=1.0, seed=11)
        assert (await pair.submit(task, remote=remote)).ok
        choices = await _choices(pair, task)
        for index, chunks in enumerate(choices.values()):
            assert [c.index for c in chunks] == list(range(len(chunks)))
            assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 5
            alone = make_task(f"alone{index}", 70, max_tokens=5)
            alone.sampling = choice_sampling(task.sampling, index)
            assert (await pair.submit(alone, remote=remote)).ok
            await pair.outcome(alone.attempt_id)
            assert [t for c in chunks for t in c.token_ids] == pair.tokens(alone.attempt_id)
        await pair.idle()
        assert pair.decode_freed["g~0"] == 1 and pair.decode_freed["g~1"] == 1
        assert pair.prefill_freed.get("g", 0) == (1 if remote else 0)
        assert pair.decode.snapshot().kv_blocks_leaked == 0


@pytest.mark.parametrize("n, temperature", [(1, 0.0), (3, 1.0)])
async def test_penalties_hold_across_the_handoff(tiny_model, n, temperature):
    """The prefill worker draws each choice's first token under the penalties and the bias; the
    decode worker rebuilds each choice's counts from the tokens (nothing else travels): a remote
    prefill streams what a local one does."""
    penalised = dict(
        n=n,
        temperature=temperature,
        seed=3,
        repetition_penalty=1.4,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        bias_token_ids=[7, 50],
        bias_values=[4.0, -100.0],
    )
    async with Pair(tiny_model) as pair:
        streamed = {}
        for remote, name in ((True, "remote"), (False, "local"), (False, "plain")):
            task = make_task(name, 70, max_tokens=8)
            asked = penalised if name != "plain" else dict(n=n, temperature=temperature, seed=3)
            task.sampling = dataclasses.replace(task.sampling, **asked)
            assert (await pair.submit(task, remote=remote)).ok
            if n == 1:
                await pair.outcome(name)
                streamed[name] = [pair.tokens(name)]
            else:
                chunks = await _choices(pair, task)
                streamed[name] = [[t for c in cs for t in c.token_ids] for cs in chunks.values()]
        assert streamed["remote"] == streamed["local"] != streamed["plain"]
        await pair.idle()
        assert pair.decode.snapshot().kv_blocks_leaked == 0


async def test_a_group_that_fails_before_its_first_token_fails_every_choice(tiny_model):
    async with Pair(tiny_model) as pair:
        pair.decode_plane.hold = True
        pair.liveness.gone.add(PREFILL)
        task = make_task("g", 200)
        task.sampling = dataclasses.replace(task.sampling, n=2)
        assert (await pair.submit(task)).ok
        choices = await _choices(pair, task)
        assert [c[-1].failure.avoid for c in choices.values()] == [PREFILL, PREFILL]
        pair.decode_plane.hold = False
        pair.liveness.gone.clear()
        await pair.idle()


async def test_choice_0_cancelled_before_the_fork_leaves_the_others(tiny_model):
    """Choice 0's stream moved on (its relay cancelled it) while the group was still prefilled:
    the other choices are not touched."""
    async with Pair(tiny_model) as pair:
        pair.decode_plane.hold = True  # the KV cannot land yet: the group is not forked
        task = make_task("g", 200, max_tokens=3)
        task.sampling = dataclasses.replace(task.sampling, n=3)
        assert (await pair.submit(task)).ok
        await until(lambda: in_flight(pair, "g"))
        await pair.bus.publish(pair.subjects.cancel, CancelRequest(attempt_id="g~0"))
        pair.decode_plane.hold = False
        choices = await _choices(pair, task)
        assert [c[-1].finish_reason for c in choices.values()] == ["cancelled", "length", "length"]
        await pair.idle()
        assert pair.decode.snapshot().kv_blocks_leaked == 0


async def test_a_prefill_result_short_of_first_tokens_fails_every_choice(tiny_model):
    async with Pair(tiny_model) as pair:
        real = pair.prefill.engine._first_of_each

        def one_only(seq, draws):  # a faulty prefill worker: one first token for three choices
            return real(seq, draws[:1])

        pair.prefill.engine._first_of_each = one_only
        task = make_task("g", 70)
        task.sampling = dataclasses.replace(task.sampling, n=3)
        assert (await pair.submit(task)).ok
        choices = await _choices(pair, task)
        failures = [c[-1].failure for c in choices.values()]
        assert all(
            f.avoid == PREFILL and "1 first tokens for 3 choices" in f.message for f in failures
        )
        await pair.idle()
