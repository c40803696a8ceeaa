"""JobThread: jobs run in its one thread, in order; results and errors reach the
awaiting coroutine; closing waits for the job running and cancels those not started."""

import asyncio
import threading

import pytest

from shared.job_thread import JobThread


async def test_jobs_run_in_order_on_one_thread_off_the_loop():
    executor, seen = JobThread(), []
    try:
        results = await asyncio.gather(
            *(
                executor.run(lambda i=i: seen.append((i, threading.get_ident())) or i)
                for i in range(50)
            )
        )
    finally:
        executor.close()
    assert results == list(range(50)) and [i for i, _ in seen] == list(range(50))
    threads = {t for _, t in seen}
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_an_error_reaches_the_caller_and_the_thread_goes_on():
    executor = JobThread()

    def fails():
        raise KeyError("boom")

    try:
        with pytest.raises(KeyError, match="boom"):
            await executor.run(fails)
        assert await executor.run(lambda a, b: a + b, 2, 3) == 5
    finally:
        executor.close()


async def test_close_waits_for_the_running_job_and_cancels_the_rest():
    executor, started, release = JobThread(), threading.Event(), threading.Event()
    ran = []

    def long():
        started.set()
        release.wait(5)
        ran.append("long")
        return "done"

    first = asyncio.ensure_future(executor.run(long))
    second = asyncio.ensure_future(executor.run(lambda: ran.append("second")))
    await asyncio.to_thread(started.wait, 5)
    threading.Timer(0.05, release.set).start()
    executor.close()  # returns once `long` has ended
    assert ran == ["long"]
    assert await first == "done"
    with pytest.raises(asyncio.CancelledError):
        await second
    with pytest.raises(RuntimeError, match="closed"):
        await executor.run(lambda: None)


async def test_a_caller_that_gave_up_does_not_break_the_thread():
    executor, release = JobThread(), threading.Event()
    try:
        waiting = asyncio.ensure_future(executor.run(release.wait, 5))
        await asyncio.sleep(0.01)
        waiting.cancel()
        release.set()
        assert await executor.run(lambda: 7) == 7
    finally:
        executor.close()
