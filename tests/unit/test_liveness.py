"""Liveness over an in-memory bus and a fake clock: a worker is lost after its heartbeats stop for
the timeout, or after a second when nothing listens on its ping subject any more."""

from shared.control.liveness import Liveness
from shared.control.messages import KVLayout, WorkerHeartbeat
from shared.control.subjects import Subjects
from shared.worker.announcer import Announcer
from tests.fakes.bus import InMemoryBus

SUBJECTS = Subjects("c")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: str) -> WorkerHeartbeat:
    layout = KVLayout(model="m", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=8)
    return WorkerHeartbeat(
        worker_id=worker_id,
        role="decode",
        host="h",
        pid=1,
        ucx_address=b"a",
        layout=layout,
        max_model_len=64,
    )


async def watching(clock: Clock) -> tuple[InMemoryBus, Liveness]:
    bus = InMemoryBus()
    live = Liveness(bus, SUBJECTS, timeout_s=3.0, clock=clock)
    await live.__aenter__()
    clock.now += 5  # past the first timeout: no reconnect of ours to wait out
    return bus, live


async def test_a_silent_worker_still_on_nats_waits_out_the_timeout():
    clock = Clock()
    bus, live = await watching(clock)
    # it beats once, and answers pings
    async with Announcer(bus, SUBJECTS, "w1", lambda: beat("w1"), interval_s=3600):
        asked = []
        request = bus.request

        async def counted(subject, *args):
            asked.append(subject)
            return await request(subject, *args)

        bus.request = counted
        clock.now += 2.0
        assert not await live.lost("w1")  # silent 2 s, but listening: only slow
        clock.now += 0.5
        # that answer stands a second
        assert not await live.lost("w1") and asked == [SUBJECTS.ping("w1")]
        clock.now += 0.6
        assert await live.lost("w1") and not live.alive("w1")  # the timeout decides


async def test_a_worker_gone_from_nats_is_lost_after_a_second():
    clock = Clock()
    bus, live = await watching(clock)
    await live.on_heartbeat(beat("w1"), None)  # it beat, and has no ping subscription (killed)
    clock.now += 0.5
    assert not await live.lost("w1")  # one missed beat proves nothing
    clock.now += 0.6
    assert await live.lost("w1") and live.alive("w1")  # gone from NATS, long before the timeout


async def test_after_our_own_reconnect_only_the_timeout_counts():
    clock = Clock()
    bus, live = await watching(clock)
    await live.on_heartbeat(beat("w1"), None)
    bus.reconnects += 1  # subscriptions may still be coming back
    clock.now += 1.5
    assert not await live.lost("w1")
    clock.now += 1.6
    assert await live.lost("w1")  # silent past the timeout: lost all the same
    await live.on_heartbeat(beat("w2"), None)
    clock.now += 1.5  # a timeout after the reconnect was noticed: the quick rule is back
    assert await live.lost("w2")
