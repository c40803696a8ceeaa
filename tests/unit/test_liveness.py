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
    assert not await live.lost("w1")  # silence before the reconnect is no evidence
    clock.now += 2.0
    assert not await live.lost("w1")  # the quick rule waits out a timeout after it
    clock.now += 1.1
    assert await live.lost("w1")  # silent a timeout since: lost all the same
    await live.on_heartbeat(beat("w2"), None)
    clock.now += 1.5  # a timeout after the reconnect was noticed: the quick rule is back
    assert await live.lost("w2")


async def test_silence_while_our_own_connection_is_down_is_no_evidence():
    """NATS down for 10 s: no heartbeat reaches us, yet nobody is lost; after it comes back the
    worker gets a whole timeout again (it failed before: lost the moment the timeout passed)."""
    clock = Clock()
    bus, live = await watching(clock)
    await live.on_heartbeat(beat("w1"), None)
    bus.connected = False
    for _ in range(10):
        clock.now += 1.0
        assert not await live.lost("w1") and live.alive("w1")
    bus.connected, bus.reconnects = True, bus.reconnects + 1
    clock.now += 0.5
    assert not await live.lost("w1")
    await live.on_heartbeat(beat("w1"), None)  # its first beat after the reconnect
    clock.now += 2.9
    assert not await live.lost("w1")
    clock.now += 0.2
    assert await live.lost("w1")  # silent a timeout while we could hear: lost


async def test_a_stalled_server_is_not_a_dead_worker():
    """The server is stopped (SIGSTOP): our connection looks up, nobody's heartbeat comes, the
    server answers no ping. Nobody is lost; once it answers again, silence counts from then."""
    clock = Clock()
    bus, live = await watching(clock)
    await live.on_heartbeat(beat("w1"), None)
    bus.server_up = False
    for _ in range(20):
        clock.now += 1.0
        assert not await live.lost("w1")
    bus.server_up = True
    clock.now += 1.0
    assert not await live.lost("w1")  # heard nothing from it yet, but only for a second
    clock.now += 2.5
    assert not await live.lost("w1")  # the server answers: hearing again, from now
    clock.now += 3.1
    assert await live.lost("w1")  # a timeout since, and nothing from w1: lost


async def test_silence_counts_when_others_are_heard():
    clock = Clock()
    bus, live = await watching(clock)
    await live.on_heartbeat(beat("w1"), None)
    bus.server_up = False  # no ping answered, but w2's heartbeats come: we can hear
    for _ in range(4):
        clock.now += 0.9
        await live.on_heartbeat(beat("w2"), None)
    assert await live.lost("w1")


async def test_after_a_stall_silence_counts_from_when_hearing_came_back():
    """The server resumes; another worker's beat comes first. The silence since the last failed
    probe (up to a timeout old) must not count: before, the worker was lost at once."""
    clock = Clock()
    bus, live = await watching(clock)
    await live.on_heartbeat(beat("w1"), None)
    bus.server_up = False
    clock.now += 3.5
    assert not await live.lost("w1")  # the probe fails: deaf from here
    clock.now += 3.2  # nobody asks meanwhile (a probe comes a timeout after the last)
    bus.server_up = True
    await live.on_heartbeat(beat("w2"), None)  # w2's beat comes first
    clock.now += 0.1
    assert not await live.lost("w1")
    clock.now += 3.0
    assert await live.lost("w1")  # a timeout since hearing came back, and w1 still silent
