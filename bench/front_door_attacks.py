"""The front-door benchmark's hostile client (bench/front_door.py), run in a process of its own so
that its work never delays the normal client's clock. Every socket it opens comes from
`source` (127.0.0.2 by default: on Linux all of 127/8 is loopback), so the gateway sees it as
another client than the normal one on 127.0.0.1.

Attacks (each runs until told to stop, then reports what it saw):
  half_open:     `count` connections held at once, each sending part of a request and stalling:
                 half send part of the headers, half whole headers and part of the body; each
                 one the gateway closes is replaced. Per socket: when it opened, when the gateway
                 closed it (EOF or reset) and the status line it answered with, if any.
  message_flood: `workers` concurrent requests of `messages` empty user messages (each body
                 under 1 MiB), sent again as each answer comes.
  big_bodies:    `workers` concurrent 1 MiB bodies: all but one of ~4,000 short messages, one of
                 a few huge text messages; sent again as each answer comes.
Each also sends, once the attack is under way, two deeply nested JSON bodies (100,000 '['; and a
well-formed request nested as deep) from `deep_source` (a third address: a per-client limit that
the attack itself trips must not answer for them) and records their statuses.
"""

import asyncio
import json
import time
from collections import Counter

import aiohttp

from bench.half_open import half_open

MIB = 1 << 20
DEPTH = 100_000
FLOOD_TIMEOUT_S = 300.0  # one attack request, answer included
CONNECT_TIMEOUT_S = 10.0
SHORT_TEXT = "the quick brown fox jumps over the lazy dog "


def _envelope(model: str, messages_json: str) -> bytes:
    head = json.dumps({"model": model, "max_tokens": 32, "stream": True}, separators=(",", ":"))
    return (head[:-1] + ',"messages":[' + messages_json + "]}").encode()


def empty_messages_body(model: str, count: int) -> bytes:
    return _envelope(model, ",".join(['{"role":"user","content":""}'] * count))


def tiny_messages_body(model: str, count: int, size: int = MIB - 1024) -> bytes:
    """`count` user messages of short text, the body just under `size` bytes."""
    frame = len('{"role":"user","content":""},')
    each = max(1, (size - 200) // count - frame)
    text = (SHORT_TEXT * (each // len(SHORT_TEXT) + 1))[:each]
    message = json.dumps({"role": "user", "content": text}, separators=(",", ":"))
    return _envelope(model, ",".join([message] * count))


def huge_text_body(model: str, count: int = 4, size: int = MIB - 1024) -> bytes:
    words = "word " * ((size - 400) // count // 5)
    message = json.dumps({"role": "user", "content": words}, separators=(",", ":"))
    return _envelope(model, ",".join([message] * count))


def deep_bodies(model: str) -> dict[str, bytes]:
    nested = "[" * DEPTH + "]" * DEPTH
    well_formed = (
        f'{{"model":{json.dumps(model)},"messages":[{{"role":"user","content":{nested}}}]}}'
    )
    return {"open_brackets": b"[" * DEPTH, "deep_content": well_formed.encode()}


class Requests:
    """Each request's outcome (its HTTP status, or the error that ended it) and latency."""

    def __init__(self) -> None:
        self.statuses: Counter = Counter()
        self.latencies_ms: list[float] = []

    async def post(self, session: aiohttp.ClientSession, url: str, body: bytes) -> str:
        started = time.perf_counter()
        try:
            headers = {"Content-Type": "application/json"}
            async with session.post(url, data=body, headers=headers) as reply:
                await reply.read()
                outcome = str(reply.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            outcome = type(err).__name__
        self.statuses[outcome] += 1
        self.latencies_ms.append((time.perf_counter() - started) * 1000)
        return outcome

    def report(self) -> dict:
        return {"statuses": dict(self.statuses), "latencies_ms": self.latencies_ms}


def session_from(source: str) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, local_addr=(source, 0))
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=FLOOD_TIMEOUT_S)
    )


async def repeat(session, url: str, body: bytes, requests: Requests, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await requests.post(session, url, body)


async def flood(config: dict, bodies: dict[str, tuple[int, bytes]], stop: asyncio.Event) -> dict:
    """`bodies`: kind -> (how many workers send it, the body)."""
    url = config["base_url"] + "/v1/chat/completions"
    kinds = {kind: Requests() for kind in bodies}
    async with session_from(config["source"]) as session:
        tasks = [
            asyncio.create_task(repeat(session, url, body, kinds[kind], stop))
            for kind, (workers, body) in bodies.items()
            for _ in range(workers)
        ]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {kind: r.report() for kind, r in kinds.items()}


async def deep_json(config: dict, model: str) -> dict:
    """Each deeply nested body once: its status (the bar: 400)."""
    url = config["base_url"] + "/v1/chat/completions"
    out = {}
    async with session_from(config["deep_source"]) as session:
        for name, body in deep_bodies(model).items():
            requests = Requests()
            out[name] = await requests.post(session, url, body)
    return out


def bodies_for(kind: str, config: dict) -> dict[str, tuple[int, bytes]]:
    model = config["model"]
    if kind == "message_flood":
        body = empty_messages_body(model, config["flood_messages"])
        return {"empty_messages": (config["flood_workers"], body)}
    tiny = tiny_messages_body(model, config["tiny_messages"])
    return {
        "tiny_messages": (config["big_workers"] - 1, tiny),
        "huge_text": (1, huge_text_body(model)),
    }


async def attack(kind: str, config: dict, stopped) -> dict:
    """`stopped`: a callable saying when the parent wants the attack over."""
    stop = asyncio.Event()
    if kind == "half_open":
        task = asyncio.create_task(half_open(config, stop))
    else:
        task = asyncio.create_task(flood(config, bodies_for(kind, config), stop))
    await asyncio.sleep(config["deep_after_s"])
    deep = await deep_json(config, config["model"])
    while not stopped():
        await asyncio.sleep(0.1)
    stop.set()
    return {"kind": kind, "deep_json": deep, **(await task)}


def run(kind: str, config: dict, stop_event, results) -> None:
    """A process's target: the attack until `stop_event` is set, its report put on `results`."""
    results.put(asyncio.run(attack(kind, config, stop_event.is_set)))
