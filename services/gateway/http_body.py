"""Reading an HTTP request's body: bounded in size, not kept past its parse, decoded at a
bounded cost, and each client's bodies one at a time, at no more than half the loop's time while
others are served (BodyTurns).

Decoding JSON costs by its objects more than by its bytes (36,000 empty chat messages in 1 MiB:
12 ms of the event loop, every one of them a dict), so decoding stops at MAX_OBJECTS, more than
any request the API takes can hold: a message each, a content part each, and a few of its own.
"""

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

from aiohttp import web

from shared.control import rules

BODY_CHUNK = 64 * 1024
MAX_OBJECTS = rules.MAX_MESSAGES + rules.MAX_CONTENT_PARTS + 64


class TooManyObjects(ValueError):
    """A body of more JSON objects than any request holds (400)."""


def decode_json(body: bytes | bytearray):
    """The body's JSON; ValueError when it is not JSON or holds more than MAX_OBJECTS objects
    (RecursionError when nested too deeply for the decoder)."""
    count = 0

    def counted(obj: dict) -> dict:
        nonlocal count
        count += 1
        if count > MAX_OBJECTS:
            raise TooManyObjects(f"the body holds more than {MAX_OBJECTS} JSON objects")
        return obj

    return json.loads(body, object_hook=counted)


class BodyTooLarge(ValueError):
    """A request body over the gateway's limit (413)."""


async def read_body(request: web.Request, limit: int) -> bytearray:
    """The request's body, at most `limit` bytes (BodyTooLarge past it, by its Content-Length
    before a byte is read, or while reading one that has none). Read here rather than by
    aiohttp's request.read(), which keeps the bytes for as long as the request lives."""
    too_large = BodyTooLarge(f"the body is over the {limit}-byte limit")
    if (request.content_length or 0) > limit:
        raise too_large
    body = bytearray()
    while chunk := await request.content.read(BODY_CHUNK):
        body += chunk
        if len(body) > limit:
            raise too_large
    return body  # json decodes it as it is: no copy


class Bill:
    """The event loop's time one body took to decode and parse (what its turn is charged)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def timing(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started


class BodyTurns:
    """Each client's bodies are read and decoded one at a time, in the order they came; and while
    other clients are served, a client's next body waits as long as its last one took to decode.

    Reading and decoding run on the event loop, between every other stream's chunks: a client
    that sends 40 large bodies at once would otherwise have 40 in progress there, and every other
    stream waits behind all of them. One at a time, another client's work waits for one step of
    one of them at most, and a client's own slow body holds back only that client. The wait after
    each body holds a client that sends costly bodies back to back to half of the loop's time
    while anyone else is served (all of it when it is alone). Waiting here costs a seat (the
    client's fair share bounds how many) and no byte read.

    `contended(client)`: whether another client is being served now."""

    def __init__(self, contended: Callable[[str], bool], sleep=asyncio.sleep) -> None:
        self._contended, self._sleep = contended, sleep
        self._locks: dict[str, asyncio.Lock] = {}  # by client; only while one is in use
        self._users: dict[str, int] = {}

    @property
    def clients(self) -> int:
        """Clients with a body being read or waiting for its turn."""
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def turn(self, client: str):
        """The client's turn: the block reads and decodes one body, timing that with the Bill
        it is given."""
        lock = self._locks.setdefault(client, asyncio.Lock())
        self._users[client] = self._users.get(client, 0) + 1
        try:
            async with lock:
                bill = Bill()
                yield bill
                if bill.seconds and self._contended(client):
                    await self._sleep(bill.seconds)
        finally:
            self._users[client] -= 1
            if not self._users[client]:
                del self._users[client], self._locks[client]
