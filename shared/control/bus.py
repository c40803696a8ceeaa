"""The control-plane bus: typed messages over NATS, behind a small interface (the in-memory fake
for unit tests is tests/fakes/bus.py)."""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import nats
import nats.errors
from opentelemetry import context as otel_context
from opentelemetry import propagate

from shared.control.attempts import AboutAnAttempt
from shared.control.nats_auth import inbox_prefix
from shared.control.subjects import Subjects
from shared.control.wire import MessageError, decode, encode
from shared.telemetry.request_log import request_scope

log = logging.getLogger(__name__)

# nats-py's buffer holds 2 MiB of unsent messages, then blocks (server stalled) or raises
# (reconnecting); try_publish stops short of it
BACKED_UP_BYTES = 1024 * 1024
MAX_OUTSTANDING_PINGS = 2  # pings unanswered before the server is given up (see BusTiming)


@dataclass(frozen=True)
class BusTiming:
    """How the client keeps its connection (CommonSettings' nats_* settings give the values).

    A server that stops answering without closing the connection (its host cut off, or frozen) is
    given up within ping_interval_s x (MAX_OUTSTANDING_PINGS + 1), and the cluster's servers tried
    in random order, each for connect_timeout_s at most (the lost one may come first): with these
    defaults a client is on another server within about 5 s. With nats-py's own (a ping every 2
    minutes, 2 missed) a client stayed deaf for minutes."""

    connect_timeout_s: float = 2.0
    ping_interval_s: float = 1.0
    reconnect_wait_s: float = 0.5  # before a server that could not be reached is tried again
    drain_timeout_s: float = 5.0  # on leaving: unsent messages and subscriptions, then closed


Respond = Callable[[Any], Awaitable[None]]
Handler = Callable[[Any, Respond | None], Awaitable[None]]


def redacted(url: str) -> str:
    """`url` without any user:password@ in it, for logs."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rsplit("@", 1)[-1] if sep else url.rsplit("@", 1)[-1]


def server_urls(url: str) -> list[str]:
    """The servers in a NATS URL setting: one URL, or a cluster's separated by commas."""
    return [part.strip() for part in url.split(",") if part.strip()]


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
    dropped: int  # malformed or out-of-range messages received and dropped (a metric)
    reconnects: int  # times the connection came back (messages in flight then may be lost)

    @property
    def connected(self) -> bool: ...  # False while the connection is down (reconnecting)

    async def reachable(self, timeout: float) -> bool: ...  # the server answers within timeout

    async def try_publish(self, subject: str, message: Any) -> bool: ...

    async def publish(self, subject: str, message: Any) -> None: ...

    async def request(self, subject: str, message: Any, timeout: float, expected: type) -> Any: ...

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription: ...


class NatsBus:
    """The real bus. Use as `async with NatsBus(url, name) as bus:`; leaving drains the connection.
    `url` may name several servers of one NATS cluster, separated by commas: the client connects
    to one of them and, when that one is lost, reconnects to another."""

    def __init__(
        self,
        url: str,
        name: str,
        options: dict | None = None,
        role: str = "",
        cluster: str = "default",
        tracing: bool = False,
        timing: BusTiming = BusTiming(),
    ):
        self._timing = timing
        self._servers = server_urls(url)
        self._tracing = tracing  # the trace context travels in message headers
        self._shown_url = ",".join(redacted(u) for u in self._servers)
        self._server = self._shown_url  # the one connected to, once known
        self._name = name
        # credentials and TLS (shared.settings.nats_options): never logged
        self._options = options or {}
        if role:  # answers come to _INBOX.<role>.…: the only inboxes this role's NATS user may read
            self._options = {**self._options, "inbox_prefix": inbox_prefix(role)}
        self._nc: nats.NATS | None = None
        self._probe_subject = Subjects(cluster).probe  # nobody subscribes: see reachable()
        self._closing = False
        self._outage_logged = False  # the outage under way was logged already
        self.dropped = 0
        self.reconnects = 0

    async def __aenter__(self) -> "NatsBus":
        self._nc = await nats.connect(
            servers=self._servers,
            name=self._name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=self._timing.reconnect_wait_s,
            connect_timeout=self._timing.connect_timeout_s,
            ping_interval=self._timing.ping_interval_s,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
            **self._options,
        )
        self._note_server()
        return self

    async def __aexit__(self, *exc) -> None:
        self._closing = True
        if self._nc is not None and not self._nc.is_closed:
            try:
                await asyncio.wait_for(self._nc.drain(), self._timing.drain_timeout_s)
            except (asyncio.TimeoutError, nats.errors.Error) as err:
                log.warning("NATS drain did not finish cleanly: %s", err)
                try:  # the server may be gone: closing then fails too, and that is fine
                    await self._nc.close()
                except (OSError, nats.errors.Error) as closing:
                    log.warning("NATS connection closed uncleanly: %s", closing)

    async def _on_error(self, err: Exception) -> None:
        if self.connected or not self._outage_logged:  # one line per outage, not per retry
            log.warning("NATS error: %s", err)
        self._outage_logged = not self.connected

    async def _on_disconnect(self) -> None:
        if not self._closing:
            log.warning("disconnected from NATS at %s", self._server)

    async def _on_reconnect(self) -> None:
        self._outage_logged = False
        self.reconnects += 1
        self._note_server()
        log.info("reconnected to NATS at %s", self._server)

    def _note_server(self) -> None:
        """Which of the servers the connection is on now, for logs."""
        current = self._nc.connected_url if self._nc is not None else None
        self._server = redacted(current.geturl()) if current else self._shown_url

    @property
    def max_payload(self) -> int:
        return self._nc.max_payload

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def reachable(self, timeout: float) -> bool:
        """True when the server answers within `timeout` (False: down, stopped, or far). A request
        on a subject nobody listens to: the server itself answers it, "no responders". (Not
        nats-py's flush(timeout): a PONG after its timeout kills the client's read loop.)"""
        if not self.connected:
            return False
        try:
            await self._nc.request(self._probe_subject, b"", timeout=timeout)
        except nats.errors.NoRespondersError:
            return True
        except Exception:  # timeout, reconnecting, closed: not reachable now
            return False
        return True  # somebody answered: the server is there all the same

    def _headers(self) -> dict[str, str] | None:
        """The current trace context (W3C traceparent) for a message's headers; None: off."""
        if not self._tracing:
            return None
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return carrier or None

    async def publish(self, subject: str, message: Any) -> None:
        await self._nc.publish(subject, encode(message), headers=self._headers())

    async def try_publish(self, subject: str, message: Any) -> bool:
        """Publishes unless the connection is down or backed up; False when it did not. Never
        blocks on a stalled server and never raises: the caller keeps what it could not send."""
        if not self.connected or self._nc.pending_data_size > BACKED_UP_BYTES:
            return False
        try:
            await self._nc.publish(subject, encode(message), headers=self._headers())
        except nats.errors.Error as err:
            log.debug("publish on %s failed: %s", subject, err)
            return False
        return True

    async def request(self, subject: str, message: Any, timeout: float, expected: type) -> Any:
        try:
            reply = await self._nc.request(
                subject, encode(message), timeout=timeout, headers=self._headers()
            )
        except nats.errors.NoRespondersError:
            raise NoResponders(f"nobody listens on {subject}") from None
        except nats.errors.TimeoutError:
            raise RequestTimeout(f"no answer on {subject} within {timeout:.1f}s") from None
        try:
            return decode(reply.data, expected)
        except MessageError as err:  # a malformed answer is no answer
            self.dropped += 1
            raise BadReply(f"malformed answer on {subject}: {err}") from None

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription:
        async def on_message(msg) -> None:
            try:
                message = decode(msg.data)
            except MessageError as err:
                self.dropped += 1
                log.warning(
                    "dropped a malformed message on %s (%d so far): %s",
                    msg.subject,
                    self.dropped,
                    err,
                )
                return
            token = None
            if self._tracing and msg.headers:  # the handler works within the sender's trace
                token = otel_context.attach(propagate.extract(msg.headers))
            try:
                with request_scope(_request_of(message)):
                    await handler(message, self._responder(msg.reply) if msg.reply else None)
            except Exception:
                log.exception("handler for %s failed", msg.subject)
            finally:
                if token is not None:
                    otel_context.detach(token)

        return await self._nc.subscribe(subject, queue=queue, cb=on_message)

    def _responder(self, reply_subject: str) -> Respond:
        """Answers a request (not traced: the answer goes back to the span that asked)."""

        async def respond(answer: Any) -> None:
            await self._nc.publish(reply_subject, encode(answer))

        return respond


def _request_of(message: Any) -> str:
    """The request a message is about (its attempt id), for the log lines of its handler."""
    return message.attempt_id if isinstance(message, AboutAnAttempt) else ""
