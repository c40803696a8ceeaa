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
