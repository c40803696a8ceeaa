"""Seats and fair shares: a lone client may fill the queue, busy clients share it equally, a
client's caps hold over every gateway replica, and a client behind a trusted proxy is the address
the proxy forwarded."""

import asyncio

import grpc
import pytest

from services.gateway.clients import Client, ClientKeys, ClientPolicy, TrustedProxies
from services.gateway.holdings_exchange import STALE_INTERVALS, HoldingsExchange
from services.gateway.seats import Holding, Refused, Seats, SeatState
from shared.control.fair_share import level, within_share
from shared.control.holdings import GatewayHoldings
from shared.control.subjects import Subjects
from shared.control.wire import decode, encode
from tests.fakes.bus import InMemoryBus

ANYONE = ClientPolicy()


def client(name: str, **caps) -> Client:
    return Client(name, ClientPolicy(**caps))


def fill(seats: Seats, who: Client, n: int) -> list:
    return [seats.take(who) for _ in range(n)]


def test_the_level_is_max_min_fair():
    assert level(100, []) == 100  # alone: everything
    assert level(100, [100]) == 50  # beside a busy one: half
    assert level(100, [10]) == 90  # beside one that holds little: the rest
    assert level(90, [10, 100]) == 40  # 10 held, the rest shared by the two busy ones
    assert within_share(0, 10, [1000]) and not within_share(5, 10, [1000])


def test_a_lone_client_fills_the_queue_and_a_second_gets_half():
    seats = Seats(max_streams=100, max_queued=8)
    a, b = client("addr:a"), client("addr:b")
    held = fill(seats, a, 8)  # alone: the whole queue
    with pytest.raises(Refused) as err:
        seats.take(a)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "fair share" in str(err.value)
    fill(seats, b, 4)  # beside a busy client: half, though the queue is full
    with pytest.raises(Refused):
        seats.take(b)
    for seat in held[:5]:  # a's requests leave the queue (started or ended) ...
        seats.validated(seat, 10)
        seats.started(seat)
    assert seats.held()["addr:a"] == Holding(streams=8, queued=3, kv_tokens=50)
    seats.take(a)  # ... and it is under its half again


def test_a_full_gateway_is_unavailable_and_every_seat_comes_back():
    seats = Seats(max_streams=3, max_queued=100)
    taken = fill(seats, client("addr:a"), 2) + fill(seats, client("addr:b"), 1)
    with pytest.raises(Refused) as err:
        seats.take(client("addr:c"))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    seats.validated(taken[0], 100)
    seats.started(taken[0])
    for seat in taken + taken[:1]:  # releasing twice does nothing
        seats.release(seat)
    assert seats.open == 0 and not seats.held()
    assert taken[0].state is SeatState.CLOSED
    with pytest.raises(RuntimeError):
        seats.started(taken[1])  # a closed seat goes nowhere


def test_a_clients_own_caps_and_its_kv_limit():
    seats = Seats(max_streams=100, max_queued=100)
    capped = client("key:small", max_streams=2, max_queued=1, max_kv_tokens=1000)
    first = seats.take(capped)
    with pytest.raises(Refused, match="waiting"):
        seats.take(capped)
    seats.validated(first, 600)
    seats.started(first)
    second = seats.take(capped)
    with pytest.raises(Refused, match="streams open"):
        seats.take(capped)
    with pytest.raises(Refused, match="KV tokens"):
        seats.validated(second, 500)
    assert second.state is SeatState.VALIDATING  # refused: the caller releases it
    seats.release(second)
    assert seats.held()["key:small"] == Holding(1, 0, 600)


class StaticPeers:
    def __init__(self, held: dict, capacity: int):
        self._held, self._capacity = held, capacity

    def held(self):
        return self._held

    def queued_capacity(self) -> int:
        return self._capacity


def test_caps_and_shares_count_what_other_replicas_hold():
    peers = StaticPeers({"key:a": Holding(2, 2, 0), "addr:b": Holding(6, 6, 0)}, capacity=8)
    seats = Seats(max_streams=100, max_queued=8, peers=peers)
    with pytest.raises(Refused, match="streams open"):
        seats.take(client("key:a", max_streams=2))  # both held at the other replica
    seats.take(client("key:c", max_streams=2))  # another key's are its own
    # a queue of 16 over both replicas: beside clients holding 1, 2 and 6 a newcomer gets 7
    newcomer = client("addr:d")
    held = []
    with pytest.raises(Refused, match="fair share"):
        while True:
            held.append(seats.take(newcomer))
    assert len(held) == level(16, [2, 6, 1])


def test_a_trusted_proxy_forwards_the_client_address():
    proxies = TrustedProxies.parse("10.0.0.0/8, 127.0.0.1")
    forwarded = [("x-forwarded-for", "203.0.113.7, 10.1.2.3")]
    assert proxies.client_of("ipv4:10.9.9.9", forwarded) == "ipv4:203.0.113.7"
    assert proxies.client_of("ipv4:127.0.0.1", [("X-Forwarded-For", "2001:db8::1")]) == (
        "ipv6:[2001:db8::1]"
    )
    # an untrusted peer cannot name itself someone else; a malformed header names nobody
    assert proxies.client_of("ipv4:198.51.100.1", forwarded) == "ipv4:198.51.100.1"
    assert proxies.client_of("ipv4:10.9.9.9", [("x-forwarded-for", "junk")]) == "ipv4:10.9.9.9"
    assert proxies.client_of("ipv4:10.9.9.9", []) == "ipv4:10.9.9.9"
    keys = ClientKeys.load("", ANYONE, proxies)
    assert keys.identify(forwarded, "", "ipv4:10.9.9.9").name == "addr:ipv4:203.0.113.7"
    assert TrustedProxies.parse("").client_of("ipv4:10.9.9.9", forwarded) == "ipv4:10.9.9.9"
    with pytest.raises(ValueError):
        TrustedProxies.parse("not-an-address")


def test_holdings_travel_as_a_wire_message():
    said = GatewayHoldings("gw-1", 512, [])
    assert decode(encode(said)) == said


async def test_replicas_count_each_others_clients_and_forget_a_silent_one():
    bus, now = InMemoryBus(), [0.0]
    subjects = Subjects("default")
    one, two = Seats(100, 4), Seats(100, 4)
    ex_one = HoldingsExchange(bus, subjects, "gw-1", one, 0.01, clock=lambda: now[0])
    ex_two = HoldingsExchange(bus, subjects, "gw-2", two, 0.01, clock=lambda: now[0])
    key = client("key:a", max_streams=3)
    async with ex_one, ex_two:
        fill(one, key, 3)
        await asyncio.sleep(0.05)  # a few intervals: each has told the other
        assert two.peers.held()["key:a"] == Holding(3, 3, 0)
        assert two.peers.queued_capacity() == 4
        with pytest.raises(Refused, match="streams open"):
            two.take(key)  # its cap holds over both replicas
        two.take(client("key:b", max_streams=3))
        now[0] += STALE_INTERVALS * 0.01 + 1  # gw-1 falls silent (its clock, its messages)
        ex_one._task.cancel()
        assert "key:a" not in two.peers.held() and two.peers.queued_capacity() == 0
    assert not bus.published or isinstance(bus.published[-1][1], GatewayHoldings)
