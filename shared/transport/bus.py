"""The control-plane bus: typed messages over NATS, behind a small interface with an in-memory fake."""

import asyncio
import logging
from typing import Any, Awaitable, Callable, Optional, Protocol

import nats
import nats.errors

from shared.nats_auth import inbox_prefix
from shared.wire import MessageError, decode, encode

log = logging.getLogger(__name__)

Respond = Callable[[Any], Awaitable[None]]
Handler = Callable[[Any, Optional[Respond]], Awaitable[None]]


def redacted(url: str) -> str:
    """`url` without any user:password@ in it, for logs."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rsplit("@", 1)[-1] if sep else url.rsplit("@", 1)[-1]


class BusError(Exception):
    """A request that got no answer."""


class NoResponders(BusError):
    """Nobody listens on the subject."""


class RequestTimeout(BusError):
    """Somebody listens, but did not answer in time."""


class BadReply(BusError):
    """The answer was not a valid message of the expected type."""


class Subscription(Protocol):
    async def unsubscribe(self) -> None: ...


class MessageBus(Protocol):
    dropped: int      # malformed or out-of-range messages received and dropped (a metric)
    reconnects: int   # times the connection came back (messages in flight then may be lost)

    async def publish(self, subject: str, message: Any) -> None: ...

    async def request(self, subject: str, message: Any, timeout: float, expected: type) -> Any: ...

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription: ...


class NatsBus:
    """The real bus. Use as `async with NatsBus(url, name) as bus:`; leaving drains the connection."""

    def __init__(self, url: str, name: str, options: dict | None = None, role: str = ""):
        self._url = url
        self._shown_url = redacted(url)
        self._name = name
        self._options = options or {}   # credentials and TLS (shared.settings.nats_options): never logged
        if role:   # answers come to _INBOX.<role>.…: the only inboxes this role's NATS user may read
            self._options = {**self._options, "inbox_prefix": inbox_prefix(role)}
        self._nc: nats.NATS | None = None
        self._closing = False
        self.dropped = 0
        self.reconnects = 0

    async def __aenter__(self) -> "NatsBus":
        self._nc = await nats.connect(
            servers=[self._url], name=self._name, max_reconnect_attempts=-1,
            reconnect_time_wait=0.5, connect_timeout=5,
            error_cb=self._on_error, disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect, **self._options)
        return self

    async def __aexit__(self, *exc) -> None:
        self._closing = True
        if self._nc is not None and not self._nc.is_closed:
            try:
                await asyncio.wait_for(self._nc.drain(), timeout=5)
            except (asyncio.TimeoutError, nats.errors.Error) as err:
                log.warning("NATS drain did not finish cleanly: %s", err)
                await self._nc.close()

    async def _on_error(self, err: Exception) -> None:
        log.warning("NATS error: %s", err)

    async def _on_disconnect(self) -> None:
        if not self._closing:
                log.warning("disconnected from NATS at %s", self._shown_url)

    async def _on_reconnect(self) -> None:
        self.reconnects += 1
        log.info("reconnected to NATS at %s", self._shown_url)

    @property
    def max_payload(self) -> int:
        return self._nc.max_payload

    async def publish(self, subject: str, message: Any) -> None:
        await self._nc.publish(subject, encode(message))

    async def request(self, subject: str, message: Any, timeout: float, expected: type) -> Any:
        try:
            reply = await self._nc.request(subject, encode(message), timeout=timeout)
        except nats.errors.NoRespondersError:
            raise NoResponders(f"nobody listens on {subject}") from None
        except nats.errors.TimeoutError:
            raise RequestTimeout(f"no answer on {subject} within {timeout:.1f}s") from None
        try:
            return decode(reply.data, expected)
        except MessageError as err:   # a malformed answer is no answer
            self.dropped += 1
            raise BadReply(f"malformed answer on {subject}: {err}") from None

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription:
        async def on_message(msg) -> None:
            try:
                message = decode(msg.data)
            except MessageError as err:
                self.dropped += 1
                log.warning("dropped a malformed message on %s (%d so far): %s", msg.subject, self.dropped, err)
                return
            try:
                await handler(message, self._responder(msg.reply) if msg.reply else None)
            except Exception:
                log.exception("handler for %s failed", msg.subject)

        return await self._nc.subscribe(subject, queue=queue, cb=on_message)

    def _responder(self, reply_subject: str) -> Respond:
        async def respond(answer: Any) -> None:
            await self._nc.publish(reply_subject, encode(answer))
        return respond


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
        data = encode(message)
        self.published.append((subject, decode(data)))
        for handler in self._targets(subject):
            await self._call(handler, decode(data), None)

    @staticmethod
    async def _call(handler: Handler, message: Any, respond: Optional[Respond]) -> None:
        try:
            await handler(message, respond)
        except Exception:  # as NatsBus: a failing handler is logged, the sender never sees it
            log.exception("handler failed")

    async def request(self, subject: str, message: Any, timeout: float, expected: type) -> Any:
        targets = self._targets(subject)
        if not targets:
            raise NoResponders(f"nobody listens on {subject}")
        answer: asyncio.Future = asyncio.get_running_loop().create_future()

        async def respond(reply: Any) -> None:
            if not answer.done():
                answer.set_result(encode(reply))

        handling = asyncio.create_task(self._call(targets[0], decode(encode(message)), respond))
        try:
            return decode(await asyncio.wait_for(answer, timeout), expected)
        except asyncio.TimeoutError:
            handling.cancel()
            raise RequestTimeout(f"no answer on {subject} within {timeout:.1f}s") from None
