"""DecodeLoop.drain: it returns as soon as the sequences it holds are done, not at its deadline."""

import asyncio
import threading
import time

from services.decode.decode_loop import DecodeLoop
from services.decode.request import DecodeRequest
from services.decode.stepper import Stepper
from shared.job_thread import JobThread
from tests.unit.test_engine import make_engine, make_seq, run_to_end, task_of


async def test_drain_returns_when_the_last_sequence_finishes(tiny_model):
    engine = make_engine(tiny_model)
    executor = JobThread()
    published, finished = [], []

    async def publish(produced):
        published.extend(out for _, out in produced)

    async def finish(req):
        finished.append(req.attempt_id)

    loop = DecodeLoop(Stepper(engine, executor, 1), publish, finish, DecodeRequest)
    try:
        seq = make_seq(list(range(3, 20)), 6, attempt_id="a")
        loop.add(DecodeRequest(seq, task_of(seq), engine), local_prefill=True)
        started = time.monotonic()
        await asyncio.wait_for(loop.drain(timeout_s=30), timeout=20)
        assert time.monotonic() - started < 10  # not the 30 s drain deadline
        assert finished == ["a"] and len(published) == 6 and not loop.requests
        assert engine.blocks.used == 0
    finally:
        executor.close()


async def test_a_cancel_while_the_loop_ends_another_request_is_reaped(tiny_model):
    """b is cancelled while the loop awaits a's end: b leaves the engine at once, so the engine
    has no work, yet b's request is still to reap; the next step reaps it and frees its blocks."""
    engine = make_engine(tiny_model)
    executor = JobThread()
    a_seq = make_seq(list(range(3, 20)), 1, attempt_id="a")
    b_seq = make_seq(list(range(5, 40)), 400, attempt_id="b")
    finished = []

    async def publish(produced):
        pass

    async def finish(req):
        finished.append(req.attempt_id)
        if req.attempt_id == "a":
            loop.requests["b"].cancel("client went away")  # as DecodeWorker.on_cancel does
            loop.wakeup.set()
            await asyncio.sleep(0)

    loop = DecodeLoop(Stepper(engine, executor, 1), publish, finish, DecodeRequest)
    stop = asyncio.Event()
    try:
        loop.add(DecodeRequest(b_seq, task_of(b_seq), engine), local_prefill=True)
        loop.add(DecodeRequest(a_seq, task_of(a_seq), engine), local_prefill=True)
        running = asyncio.create_task(loop.run(stop))
        deadline = time.monotonic() + 10
        while loop.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        loop.wakeup.set()
        await asyncio.wait_for(running, 5)
        assert finished == ["a", "b"] and not loop.requests
        assert engine.blocks.used == 0
    finally:
        executor.close()


async def test_the_next_step_runs_while_a_step_is_published_and_a_stream_ends_after_its_chunks(
    tiny_model,
):
    """Step N+1 runs in the engine thread while step N's tokens are published; each request's
    chunks are published in order, its last before the loop ends it (finish), and its blocks
    are freed."""
    engine = make_engine(tiny_model)
    executor = JobThread()
    steps_begun, overlapped, events = [0], [], []
    step = engine.step

    def counted():
        steps_begun[0] += 1
        return step()

    engine.step = counted

    async def publish(produced):
        at_start = steps_begun[0]
        for req, out in produced:
            events.append(("chunk", req.attempt_id, tuple(out.token_ids), out.finished))
        await asyncio.sleep(0.02)  # NATS is slow: the engine does not wait for it
        overlapped.append(steps_begun[0] > at_start)

    async def finish(req):
        events.append(("end", req.attempt_id))

    loop = DecodeLoop(Stepper(engine, executor, 1), publish, finish, DecodeRequest)
    try:
        for name, prompt, tokens in (("a", range(3, 20), 5), ("b", range(4, 30), 8)):
            seq = make_seq(list(prompt), tokens, attempt_id=name)
            loop.add(DecodeRequest(seq, task_of(seq), engine), local_prefill=True)
        await asyncio.wait_for(loop.drain(timeout_s=30), timeout=20)
        assert not loop.requests and engine.blocks.used == 0
    finally:
        executor.close()
    assert overlapped and all(overlapped[:4])  # while there was work, the next step ran
    for name, tokens in (("a", 5), ("b", 8)):
        mine = [e for e in events if e[1] == name]
        assert [e[0] for e in mine] == ["chunk"] * tokens + ["end"]
        assert mine[-2][3] is not None  # the last chunk says it finished, then it ends


async def test_steps_run_ahead_of_a_slow_publish_and_a_stream_gets_every_token_once(tiny_model):
    """With four steps allowed ahead, the engine steps on while the loop publishes: the tokens
    of the steps that waited go out joined, one chunk per stream, in order; each request's
    tokens are those it gets alone, its last chunk says it finished, and only then is it reaped
    (a step ends a sequence before the loop has the output that says so)."""
    alone = {}
    for name, prompt, tokens in (("a", range(3, 20), 9), ("b", range(4, 30), 12)):
        engine = make_engine(tiny_model)
        seq = make_seq(list(prompt), tokens, attempt_id=name)
        engine.add(seq)
        run_to_end(engine)
        alone[name] = seq.output_ids

    engine = make_engine(tiny_model)
    executor = JobThread()
    chunks, events = {"a": [], "b": []}, []

    async def publish(produced):
        for req, out in produced:
            chunks[req.attempt_id].append(out)
            events.append(("chunk", req.attempt_id, out.finished))
        await asyncio.sleep(0.03)  # slower than a step: steps wait to be published

    async def finish(req):
        events.append(("end", req.attempt_id))

    step = engine.step

    def slow_to_hand_over_an_end():
        outputs = step()
        if outputs and any(out.finished for _, out in outputs):
            time.sleep(0.1)  # the loop turns meanwhile: a sequence ended, its output not here
        return outputs

    engine.step = slow_to_hand_over_an_end
    loop = DecodeLoop(Stepper(engine, executor, 4), publish, finish, DecodeRequest)
    try:
        for name, prompt, tokens in (("a", range(3, 20), 9), ("b", range(4, 30), 12)):
            seq = make_seq(list(prompt), tokens, attempt_id=name)
            loop.add(DecodeRequest(seq, task_of(seq), engine), local_prefill=True)
        await asyncio.wait_for(loop.drain(timeout_s=30), timeout=20)
        assert not loop.requests and engine.blocks.used == 0 and not engine.releasing
    finally:
        executor.close()
    for name in ("a", "b"):
        assert [t for out in chunks[name] for t in out.token_ids] == alone[name]
        assert any(len(out.token_ids) > 1 for out in chunks[name])  # steps joined
        mine = [e for e in events if e[1] == name]
        assert mine[-1] == ("end", name) and mine[-2][2] is not None
        assert all(e[0] == "chunk" and e[2] is None for e in mine[:-2])


async def test_a_request_added_while_a_run_finds_nothing_to_run_is_stepped(tiny_model):
    """The run's last step found nothing; before its end reaches the loop, a request comes: the
    loop's turn for that news cannot start a run (one still runs), so the run's end must."""
    engine = make_engine(tiny_model)
    executor = JobThread()
    idle, go = threading.Event(), threading.Event()
    step = engine.step

    def step_then_linger():
        outputs = step()
        if outputs is None and not go.is_set():
            idle.set()
            go.wait(10)  # the run has found nothing; the loop turns meanwhile
        return outputs

    engine.step = step_then_linger
    finished = []

    async def publish(produced):
        pass

    async def finish(req):
        finished.append(req.attempt_id)

    loop = DecodeLoop(Stepper(engine, executor, 1), publish, finish, DecodeRequest)
    stop = asyncio.Event()
    running = asyncio.create_task(loop.run(stop))
    try:
        a = make_seq(list(range(3, 20)), 2, attempt_id="a")
        loop.add(DecodeRequest(a, task_of(a), engine), local_prefill=True)
        assert await asyncio.to_thread(idle.wait, 10)
        b = make_seq(list(range(4, 30)), 3, attempt_id="b")
        loop.add(DecodeRequest(b, task_of(b), engine), local_prefill=True)
        await asyncio.sleep(0.05)  # the loop took that news while the run still ran
        go.set()
        deadline = time.monotonic() + 10
        while "b" not in finished and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert finished == ["a", "b"] and engine.blocks.used == 0
    finally:
        go.set()
        stop.set()
        loop.wakeup.set()
        await asyncio.wait_for(running, 5)
        executor.close()
