"""EventLoopProgress drives UCX from the event loop without ever holding it: a worker that
reports progress on every round (a keepalive retried while a peer's queue is full) gets
MAX_ROUNDS rounds per wake-up, and the event loop runs between them."""

import asyncio
import os

from shared.dataplane import ucx_progress
from shared.dataplane.ucx_progress import MAX_ROUNDS, EventLoopProgress


class BusyWorker:
    """A UCX worker stand-in with an event fd that reports progress on every round, for ever
    (or until `calm`)."""

    def __init__(self):
        self.read_fd, self.epoll_file_descriptor = os.pipe()
        self.rounds = 0
        self.calm = False

    def progress_once(self) -> bool:
        self.rounds += 1
        return not self.calm

    def arm(self) -> bool:
        return self.calm

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.epoll_file_descriptor)


async def _drive(worker: BusyWorker) -> tuple[int, int]:
    progress = EventLoopProgress(worker, asyncio.get_running_loop())
    try:
        ticks = 0
        for _ in range(5):  # the event loop gets turns while UCX stays busy
            await asyncio.sleep(0)
            ticks += 1
        busy_rounds = worker.rounds
        worker.calm = True
        await asyncio.sleep(0.01)
        return ticks, busy_rounds
    finally:
        progress.stop()


def test_a_worker_busy_for_ever_does_not_hold_the_event_loop():
    worker = BusyWorker()
    try:
        ticks, busy_rounds = asyncio.run(asyncio.wait_for(_drive(worker), timeout=10))
    finally:
        worker.close()
    assert ticks == 5
    # every wake-up stops after MAX_ROUNDS rounds and comes back on the next turn
    assert MAX_ROUNDS <= busy_rounds <= 8 * (MAX_ROUNDS + 1)


def test_a_calm_worker_is_armed_after_one_round(monkeypatch):
    worker = BusyWorker()
    worker.calm = True
    monkeypatch.setattr(ucx_progress, "SAFETY_INTERVAL_S", 3600)

    async def run() -> int:
        progress = EventLoopProgress(worker, asyncio.get_running_loop())
        await asyncio.sleep(0.01)
        progress.stop()
        return progress.wakeups

    try:
        assert asyncio.run(run()) == 1
    finally:
        worker.close()
    assert worker.rounds == 1


class SignalledWorker(BusyWorker):
    """A worker whose event fd stays readable and that never arms (events keep coming), though
    no round makes progress: what a sender's UCX did after its peer died mid-transfer."""

    def __init__(self):
        super().__init__()
        self.epoll_file_descriptor, self.write_fd = self.read_fd, self.epoll_file_descriptor
        os.write(self.write_fd, b"x")  # never read: readable for good

    def progress_once(self) -> bool:
        self.rounds += 1
        return False

    def arm(self) -> bool:
        return False

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


def test_wake_ups_do_not_pile_up_when_the_event_fd_keeps_firing(monkeypatch):
    monkeypatch.setattr(ucx_progress, "SAFETY_INTERVAL_S", 3600)
    worker = SignalledWorker()

    async def run() -> int:
        progress = EventLoopProgress(worker, asyncio.get_running_loop())
        try:
            for _ in range(300):
                await asyncio.sleep(0)
            return progress.wakeups
        finally:
            progress.stop()

    try:
        wakeups = asyncio.run(asyncio.wait_for(run(), timeout=20))
    finally:
        worker.close()
    # the fd's wake-up and the one queued, each turn: a queue that grew by one wake-up a turn
    # made 300 turns cost about 45,000
    assert wakeups <= 3 * 300, wakeups
