"""Drives a workload against a gateway: each request at its arrival time, at most C in flight.

`arrivals` (seconds from the start, e.g. workload.poisson_arrivals) paces the sends; without it
every request is due at once. `concurrency` caps the requests in flight: with no arrivals that is
a closed loop keeping C busy, with arrivals a request due while C are in flight waits for a slot
(as vLLM's --max-concurrency). `duration_s` stops launching new requests after that many
seconds; the ones in flight finish and count. Several workloads can run side by side in one
event loop (asyncio.gather of run_workload calls), and their records share one clock.
"""

import asyncio
import functools
import itertools
from collections.abc import Iterable

import aiohttp

from shared.api import tandem_pb2_grpc as pb_grpc
from shared.benchmark.client import (
    GatewayUnreachable,
    RequestRecord,
    open_channel,
    send,
    wait_ready,
)
from shared.benchmark.openai_client import model_of, send_openai
from shared.benchmark.progress import Progress
from shared.benchmark.workload import RequestSpec

CONNECT_TIMEOUT_S = 10.0


async def run_workload(
    address: str,
    requests: Iterable[RequestSpec],
    *,
    arrivals: Iterable[float] | None = None,
    concurrency: int | None = None,
    duration_s: float | None = None,
    timeout_s: float | None = None,
    progress: Progress | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    api: str = "grpc",
) -> list[RequestRecord]:
    """Sends `requests` and returns one record per request sent, in send order. Raises
    GatewayUnreachable when no gateway answers at `address`; a failed request is a record, not an
    exception. `requests` may be a lazy iterator, endless when duration_s is set, but a list is
    better for measuring: building a prompt holds the event loop (and so the streams) for a few ms."""
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    launch = functools.partial(
        _launch, requests=requests, arrivals=arrivals, concurrency=concurrency,
        duration_s=duration_s, timeout_s=timeout_s, progress=progress,
    )  # fmt: skip
    if api == "openai":  # `address`: the HTTP API's base URL, e.g. http://127.0.0.1:8000
        async with _http_session() as session:
            model = await _http_model(session, address, connect_timeout_s)
            return await launch(functools.partial(send_openai, session, address, model))
    async with open_channel(address) as channel:
        await wait_ready(channel, address, connect_timeout_s)
        return await launch(functools.partial(send, pb_grpc.TandemStub(channel)))


def _http_session() -> aiohttp.ClientSession:
    # no pool limit: concurrency is the runner's to cap
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


async def _http_model(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str:
    try:
        return await asyncio.wait_for(model_of(session, base_url), timeout_s)
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        raise GatewayUnreachable(
            f"no OpenAI-compatible API answered at {base_url}: {err}"
        ) from None


async def _launch(
    sender, *, requests, arrivals, concurrency, duration_s, timeout_s, progress
) -> list[RequestRecord]:
    """`sender(spec, timeout_s)`: one request, sent over the API in use, recorded."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + duration_s if duration_s else None
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    tasks = []
    try:
        # zip takes the next spec before its arrival time: a lazily built prompt is made while waiting.
        for spec, offset in zip(requests, itertools.repeat(0.0) if arrivals is None else arrivals):
            if not await _wait_turn(start + offset, deadline, slots):
                break
            tasks.append(asyncio.create_task(_one(sender, spec, timeout_s, slots, progress)))
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # only an interrupted run leaves any unfinished


async def _wait_turn(at: float, deadline: float | None, slots: asyncio.Semaphore | None) -> bool:
    """Waits for the request's arrival time, then for a free slot; False once the deadline passed."""
    loop = asyncio.get_running_loop()
    if deadline is not None and at >= deadline:
        return False
    await asyncio.sleep(max(0.0, at - loop.time()))
    if slots is None:
        return True
    if deadline is None:
        await slots.acquire()
        return True
    try:
        await asyncio.wait_for(slots.acquire(), deadline - loop.time())
    except asyncio.TimeoutError:
        return False
    return True


async def _one(
    sender,
    spec: RequestSpec,
    timeout_s: float | None,
    slots: asyncio.Semaphore | None,
    progress: Progress | None,
) -> RequestRecord:
    if progress:
        progress.started_one()
    try:
        record = await sender(spec, timeout_s)
    finally:
        if slots:
            slots.release()
    if progress:
        progress.finished_one(record.ok)
    return record
