"""Seats: what each client holds at this gateway, one seat per request, from before its validation
to its end; and whether a client may take one more.

A seat is taken before anything costly is done for a request (reading its body, parsing,
rendering, tokenizing), so requests still being validated count. A client's requests that wait
(being validated, or placed and waiting for their first token) are its *queued* ones; every seat
is one of its *streams*. Who may take a seat:
  - this gateway holds at most `max_streams` seats in all: past it, UNAVAILABLE (503: another
    replica may have room);
  - a client's queued requests stay within its max-min fair share (fair_share.py) of the queued
    capacity, over every gateway replica (other replicas' holdings come from `peers`): a lone
    client may fill the whole queue, two busy ones get half each; past it, RESOURCE_EXHAUSTED;
  - a client's own policy (its API key's) may cap its streams, queued requests and reserved KV
    tokens further (0: no cap of its own), over every replica too.

Seat states (one owner: this module):
    VALIDATING -> WAITING -> STREAMING -> CLOSED; any state but CLOSED -> CLOSED.
"""

import collections
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from services.gateway.clients import Client
from shared.control.fair_share import within_share


class SeatState(enum.Enum):
    VALIDATING = "validating"
    WAITING = "waiting"  # placed (or being placed), no token yet
    STREAMING = "streaming"
    CLOSED = "closed"


ALLOWED = {
    SeatState.VALIDATING: {SeatState.WAITING, SeatState.CLOSED},
    SeatState.WAITING: {SeatState.STREAMING, SeatState.CLOSED},
    SeatState.STREAMING: {SeatState.CLOSED},
    SeatState.CLOSED: set(),
}
QUEUED = (SeatState.VALIDATING, SeatState.WAITING)


@dataclass(frozen=True)
class Holding:
    """What one client holds (at one gateway, or over all of them)."""

    streams: int = 0
    queued: int = 0
    kv_tokens: int = 0

    def __add__(self, other: "Holding") -> "Holding":
        return Holding(
            self.streams + other.streams,
            self.queued + other.queued,
            self.kv_tokens + other.kv_tokens,
        )


class Peers:
    """What the other gateway replicas hold, as they last said (none: a lone gateway)."""

    def held(self) -> Mapping[str, Holding]:
        return {}

    def queued_capacity(self) -> int:
        return 0


class Refused(Exception):
    """A seat was not given: `code` says which kind of no (RESOURCE_EXHAUSTED, UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, why: str):
        super().__init__(why)
        self.code = code


@dataclass(eq=False)
class Seat:
    client: Client
    kv_tokens: int = 0
    state: SeatState = field(default=SeatState.VALIDATING)


class Seats:
    def __init__(self, max_streams: int, max_queued: int, peers: Peers | None = None):
        self.max_streams = max_streams  # seats at this gateway, in all
        self.max_queued = max_queued  # this gateway's part of the queued capacity
        self.peers = peers or Peers()
        self.open = 0
        self._held: dict[str, Holding] = {}  # by client name; only clients holding a seat

    def take(self, client: Client) -> Seat:
        """A seat for one more request of `client`; Refused when it may not have one."""
        if self.open >= self.max_streams:
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                f"this gateway serves {self.max_streams} requests at once, its limit",
            )
        others = self.peers.held()
        mine = self._held.get(client.name, Holding()) + others.get(client.name, Holding())
        policy = client.policy
        if policy.max_streams and mine.streams >= policy.max_streams:
            raise _exhausted(
                f"this client already has {policy.max_streams} streams open, its limit"
            )
        if policy.max_queued and mine.queued >= policy.max_queued:
            raise _exhausted(
                f"this client already has {policy.max_queued} requests waiting, its limit"
            )
        capacity = self.max_queued + self.peers.queued_capacity()
        if not within_share(mine.queued, capacity, self._queued_of_others(client.name, others)):
            raise _exhausted(
                f"this client already has {mine.queued} requests waiting, its fair share of "
                f"the {capacity} the gateways queue while others wait too"
            )
        seat = Seat(client)
        self._change(client.name, Holding(1, 1, 0))
        self.open += 1
        return seat

    def validated(self, seat: Seat, kv_tokens: int) -> None:
        """The request is valid and will reserve `kv_tokens`; Refused (and the seat still
        validating) when that takes its client past its KV limit."""
        cap = seat.client.policy.max_kv_tokens
        held = self._held[seat.client.name].kv_tokens
        held += self.peers.held().get(seat.client.name, Holding()).kv_tokens
        if cap and held + kv_tokens > cap:
            raise _exhausted(
                f"this client's open streams would reserve more than {cap} KV tokens "
                "(prompt + max_tokens), its limit"
            )
        self._to(seat, SeatState.WAITING)
        seat.kv_tokens = kv_tokens
        self._change(seat.client.name, Holding(0, 0, kv_tokens))

    def started(self, seat: Seat) -> None:
        """Its first token came: no longer queued."""
        self._to(seat, SeatState.STREAMING)
        self._change(seat.client.name, Holding(0, -1, 0))

    def release(self, seat: Seat) -> None:
        """The request ended, however it ended; releasing twice does nothing."""
        if seat.state is SeatState.CLOSED:
            return
        queued = 1 if seat.state in QUEUED else 0
        self._to(seat, SeatState.CLOSED)
        self._change(seat.client.name, Holding(-1, -queued, -seat.kv_tokens))
        self.open -= 1

    def held(self) -> Mapping[str, Holding]:
        """What each client holds here now (only those holding a seat)."""
        return self._held

    def _queued_of_others(self, name: str, remote: Mapping[str, Holding]) -> list[int]:
        queued = collections.Counter({c: h.queued for c, h in self._held.items()})
        queued.update({c: h.queued for c, h in remote.items()})
        queued.pop(name, None)
        return list(queued.values())

    def _change(self, name: str, by: Holding) -> None:
        now = self._held.get(name, Holding()) + by
        if now.streams:
            self._held[name] = now
        else:
            self._held.pop(name, None)

    @staticmethod
    def _to(seat: Seat, state: SeatState) -> None:
        if state not in ALLOWED[seat.state]:
            raise RuntimeError(f"a seat cannot go from {seat.state.name} to {state.name}")
        seat.state = state


def _exhausted(why: str) -> Refused:
    return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
