"""HoldingsExchange: what the clients of the other gateway replicas hold, so limits and fair shares
hold over all of them (N replicas do not give a client N times its quota).

Every `interval_s` each gateway publishes what its own clients hold (GatewayHoldings) and keeps
what the others last said; a replica silent for STALE_INTERVALS intervals (stopped, killed, cut
off) is forgotten. What a gateway knows of the others is at most an interval and a NATS hop old:
two replicas taking a client's last seat in the same instant may both give it, so a cap can be
passed by the requests that arrive at other replicas within one interval. Nothing waits on the
exchange: a gateway with no peers, or no NATS, decides on what it holds itself.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from services.gateway.seats import Holding, Peers, Seats
from shared.control.bus import MessageBus
from shared.control.holdings import ClientHolding, GatewayHoldings
from shared.control.subjects import Subjects
from shared.telemetry.request_log import detached

log = logging.getLogger("gateway.holdings")

STALE_INTERVALS = 4  # a replica silent this many intervals is forgotten


class HoldingsExchange(Peers):
    def __init__(
        self,
        bus: MessageBus,
        subjects: Subjects,
        gateway_id: str,
        seats: Seats,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._bus, self._subject, self._id = bus, subjects.gateway_holdings, gateway_id
        self._interval, self._clock = interval_s, clock
        self._said: dict[str, tuple[float, GatewayHoldings]] = {}  # by gateway: when, what
        self._held: dict[str, Holding] = {}  # the others' sum by client, from _said
        self.seats = seats  # what this gateway's clients hold, told to the others
        seats.peers = self  # and what the others hold, counted by it
        self._sub = self._task = None

    async def __aenter__(self) -> "HoldingsExchange":
        self._sub = await self._bus.subscribe(self._subject, self.on_holdings)
        self._task = detached(self._tell_loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await self._sub.unsubscribe()
        await self._bus.try_publish(self._subject, GatewayHoldings(self._id, stopping=True))

    def held(self) -> Mapping[str, Holding]:
        self._forget_stale()
        return self._held

    def queued_capacity(self) -> int:
        self._forget_stale()
        return sum(h.queued_capacity for _, h in self._said.values())

    async def on_holdings(self, message: GatewayHoldings, respond) -> None:
        if message.gateway_id == self._id:
            return
        if message.stopping:
            self._said.pop(message.gateway_id, None)
        else:
            self._said[message.gateway_id] = (self._clock(), message)
        self._sum()

    def holdings(self) -> GatewayHoldings:
        """What this gateway's clients hold now, as it tells the others."""
        clients = [
            ClientHolding(name, h.streams, h.queued, h.kv_tokens)
            for name, h in self.seats.held().items()
        ]
        return GatewayHoldings(self._id, self.seats.max_queued, clients)

    async def _tell_loop(self) -> None:
        while True:
            await self._bus.try_publish(self._subject, self.holdings())
            await asyncio.sleep(self._interval)

    def _forget_stale(self) -> None:
        oldest = self._clock() - STALE_INTERVALS * self._interval
        stale = [g for g, (at, _) in self._said.items() if at < oldest]
        for gateway in stale:
            log.info("gateway %s is silent: what its clients held no longer counts", gateway)
            del self._said[gateway]
        if stale:
            self._sum()

    def _sum(self) -> None:
        held: dict[str, Holding] = {}
        for _, said in self._said.values():
            for c in said.clients:
                held[c.client] = held.get(c.client, Holding()) + Holding(
                    c.streams, c.queued, c.kv_tokens
                )
        self._held = held
