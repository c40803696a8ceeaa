"""InMemoryBus: the control-plane bus in one process for unit tests (the real one is NatsBus)."""

import asyncio
import logging
from typing import Any

from shared.control.bus import (
    BusError,
    Handler,
    NoResponders,
    RequestTimeout,
    Respond,
    Subscription,
)
from shared.control.wire import decode, encode

log = logging.getLogger(__name__)


class _FakeSubscription:
    def __init__(self, bus: "InMemoryBus", subject: str, entry: tuple):
        self._bus, self._subject, self._entry = bus, subject, entry

    async def unsubscribe(self) -> None:
        self._bus._subs[self._subject].remove(self._entry)


class InMemoryBus:
    """A bus in one process for unit tests: same encoding, same queue-group semantics, no server."""

    def __init__(self) -> None:
        self._subs: dict[str, list[tuple[str, Handler]]] = {}
        self._next_in_group: dict[tuple[str, str], int] = {}
        self.published: list[tuple[str, Any]] = []
        self.dropped = 0
        self.reconnects = 0
        self.connected = True  # False: "reconnecting" (try_publish refuses)
        self.server_up = True  # False: the "server" is stalled (reachable says no)

    async def reachable(self, timeout: float) -> bool:
        return self.connected and self.server_up

    async def try_publish(self, subject: str, message: Any) -> bool:
        if not (self.connected and self.server_up):
            return False
        await self.publish(subject, message)
        return True

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription:
        entry = (queue, handler)
        self._subs.setdefault(subject, []).append(entry)
        return _FakeSubscription(self, subject, entry)

    def _targets(self, subject: str) -> list[Handler]:
        entries = self._subs.get(subject, [])
        chosen = [h for q, h in entries if not q]
        for group in sorted({q for q, _ in entries if q}):
            members = [h for q, h in entries if q == group]
            turn = self._next_in_group.get((subject, group), 0)
            self._next_in_group[(subject, group)] = turn + 1
            chosen.append(members[turn % len(members)])
        return chosen

    async def publish(self, subject: str, message: Any) -> None:
        if not self.connected:  # as nats-py once its reconnect buffer is full
            raise BusError("not connected")
        data = encode(message)
        self.published.append((subject, decode(data)))
        for handler in self._targets(subject):
            await self._call(handler, decode(data), None)

    @staticmethod
    async def _call(handler: Handler, message: Any, respond: Respond | None) -> None:
        try:
            await handler(message, respond)
        except Exception:  # as NatsBus: a failing handler is logged, the sender never sees it
            log.exception("handler failed")

    async def request(self, subject: str, message: Any, timeout: float, expected: type) -> Any:
        data = encode(message)  # as NatsBus: a message too large fails before it is sent
        if not (self.connected and self.server_up):
            raise RequestTimeout(f"no answer on {subject}: the server is not there")
        targets = self._targets(subject)
        if not targets:
            raise NoResponders(f"nobody listens on {subject}")
        answer: asyncio.Future = asyncio.get_running_loop().create_future()

        async def respond(reply: Any) -> None:
            if not answer.done():
                answer.set_result(encode(reply))

        handling = asyncio.create_task(self._call(targets[0], decode(data), respond))
        try:
            return decode(await asyncio.wait_for(answer, timeout), expected)
        except asyncio.TimeoutError:
            handling.cancel()
            raise RequestTimeout(f"no answer on {subject} within {timeout:.1f}s") from None
