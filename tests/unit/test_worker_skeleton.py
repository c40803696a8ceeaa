"""The pieces every worker shares (shared/worker): the heartbeat builder, the leak count, the
step-and-drain loop and the serve lifecycle, over plain fakes."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from shared.worker import steps
from shared.worker.heartbeat import heartbeat, leaked_blocks
from shared.worker.serve import WorkerLifecycle


class FakeBlocks:
    def __init__(self, lock: threading.Lock):
        self.lock = lock
        self.seen: list = []

    def leaked(self, live_tables):
        assert self.lock.locked(), "the block counts are read under the engine lock"
        self.seen = live_tables
        return 3


def fake_runtime():
    lock = threading.Lock()
    return SimpleNamespace(
        worker_id="w1",
        host="h1",
        layout="the-layout",  # the whole model's, whatever its degree
        max_model_len=512,
        engine=SimpleNamespace(lock=lock),
        blocks=FakeBlocks(lock),
        load_report=lambda: {"kv_blocks_used": 5, "kv_blocks_total": 9, "kernels": "k", "tp": 2},
    )


def test_the_heartbeat_takes_the_common_fields_from_runtime_plane_bus_and_settings():
    counters = SimpleNamespace(bytes_sent=10, bytes_received=20, transfers_failed=1)
    plane = SimpleNamespace(address=b"ucx", counters=counters)
    beat = heartbeat(
        fake_runtime(),
        SimpleNamespace(zone="z1"),
        plane,
        SimpleNamespace(dropped=2),
        role="prefill",
        running=4,
        queued=6,
        served=7,
        leaked=0,
        transport="tcp",
        stopping=True,
    )
    assert (beat.worker_id, beat.role, beat.host, beat.layout) == (
        "w1",
        "prefill",
        "h1",
        "the-layout",
    )
    assert (beat.ucx_address, beat.max_model_len, beat.zone) == (b"ucx", 512, "z1")
    assert (beat.running, beat.queued, beat.requests_served) == (4, 6, 7)
    assert (beat.kv_blocks_used, beat.kv_blocks_total, beat.kernels) == (5, 9, "k")
    assert (beat.kv_bytes_sent, beat.kv_bytes_received, beat.kv_transfers_failed) == (10, 20, 1)
    assert (beat.messages_dropped, beat.kv_transport, beat.stopping) == (2, "tcp", True)
    assert beat.tp == 2


def test_the_leak_count_reads_the_held_tables_under_the_engine_lock():
    runtime = fake_runtime()
    assert leaked_blocks(runtime, lambda: [[1, 2], [3]]) == 3
    assert runtime.blocks.seen == [[1, 2], [3]]
    assert not runtime.engine.lock.locked()


async def test_the_drain_stops_as_soon_as_nothing_is_held():
    held = [3]

    async def iterate() -> bool:
        held[0] -= 1
        return held[0] > 0

    await asyncio.wait_for(steps.drain(iterate, asyncio.Event(), lambda: held[0] > 0, 5.0), 1.0)
    assert held == [0]


async def test_the_drain_gives_up_after_its_timeout():
    async def idle() -> bool:
        return False

    await asyncio.wait_for(steps.drain(idle, asyncio.Event(), lambda: True, 0.05, 0.01), 1.0)


async def test_stepping_ends_when_stop_is_set_while_idle():
    stop, wakeup = asyncio.Event(), asyncio.Event()

    async def idle() -> bool:
        stop.set()
        return False

    await asyncio.wait_for(steps.step_until_stopped(idle, wakeup, stop), 1.0)


class Recorder:
    """Bus, announcer, executor and hooks in one: each call appends its name to `calls`."""

    def __init__(self, fail_in_run: bool = False):
        self.calls: list[str] = []
        self.fail_in_run = fail_in_run

    def lifecycle(self) -> WorkerLifecycle:
        return WorkerLifecycle(
            self,
            self,
            self,
            7.0,
            subscriptions=[("a", self.handler), ("b", self.handler)],
            run=self.run,
            stop_accepting=lambda: self.calls.append("stop_accepting"),
            drain=self.drain,
            abort_rest=self.note("abort_rest"),
            cancel_tasks=lambda: self.calls.append("cancel_tasks"),
            settle_tasks=self.note("settle_tasks"),
        )

    def note(self, name: str):
        async def hook() -> None:
            self.calls.append(name)

        return hook

    async def handler(self, message, respond) -> None: ...

    async def subscribe(self, subject, handler):
        self.calls.append(f"subscribe {subject}")
        return SimpleNamespace(unsubscribe=self.note(f"unsubscribe {subject}"))

    async def __aenter__(self):
        self.calls.append("announcer up")
        return self

    async def __aexit__(self, *exc) -> None:
        self.calls.append("announcer down")

    async def announce(self) -> None:
        self.calls.append("announce")

    def close(self) -> None:
        self.calls.append("executor closed")

    async def run(self, stop: asyncio.Event) -> None:
        self.calls.append("run")
        if self.fail_in_run:
            raise RuntimeError("step failed")
        await stop.wait()

    async def drain(self, timeout_s: float) -> None:
        self.calls.append(f"drain {timeout_s}")


async def test_serve_subscribes_runs_announces_stopping_drains_aborts_and_cleans_up_in_order():
    rec, stop = Recorder(), asyncio.Event()
    stop.set()
    await rec.lifecycle().serve(stop)
    assert rec.calls == [
        "subscribe a",
        "subscribe b",
        "announcer up",
        "run",
        "stop_accepting",
        "announce",
        "drain 7.0",
        "abort_rest",
        "announcer down",
        "cancel_tasks",
        "unsubscribe a",
        "unsubscribe b",
        "settle_tasks",
        "executor closed",
    ]


async def test_serve_cleans_up_when_the_loop_fails():
    rec = Recorder(fail_in_run=True)
    with pytest.raises(RuntimeError):
        await rec.lifecycle().serve(asyncio.Event())
    assert rec.calls[rec.calls.index("run") + 1 :] == [
        "announcer down",
        "cancel_tasks",
        "unsubscribe a",
        "unsubscribe b",
        "settle_tasks",
        "executor closed",
    ]


async def test_news_during_a_step_that_found_nothing_wakes_the_next_step():
    """A handler that sets `wakeup` while a step awaits (a cancel that leaves only a request to
    reap) is not lost when that step then reports nothing to run."""
    wakeup, stop, calls = asyncio.Event(), asyncio.Event(), []

    async def iterate() -> bool:
        calls.append(len(calls))
        if len(calls) == 1:
            wakeup.set()  # the news, mid-step
            await asyncio.sleep(0)
        else:
            stop.set()
        return False

    await asyncio.wait_for(steps.step_until_stopped(iterate, wakeup, stop), 1.0)
    assert calls == [0, 1]
