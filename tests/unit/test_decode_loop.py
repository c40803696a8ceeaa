"""DecodeLoop.drain: it returns as soon as the sequences it holds are done, not at its deadline."""

import asyncio
import time

from services.decode.decode_loop import DecodeLoop
from services.decode.request import DecodeRequest
from shared.engine.executor import EngineExecutor
from tests.unit.test_engine import make_engine, make_seq, task_of


async def test_drain_returns_when_the_last_sequence_finishes(tiny_model):
    engine = make_engine(tiny_model)
    executor = EngineExecutor()
    published, finished = [], []

    async def publish(produced):
        published.extend(out for _, out in produced)

    async def finish(req):
        finished.append(req.attempt_id)

    loop = DecodeLoop(engine, executor, publish, finish, DecodeRequest)
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
    executor = EngineExecutor()
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

    loop = DecodeLoop(engine, executor, publish, finish, DecodeRequest)
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
