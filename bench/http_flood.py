"""A flooding client of the OpenAI HTTP API: `concurrency` streamed chat requests kept in flight
from one source address (any of 127/8 on loopback is another client to the gateway), each sent
again as soon as it ends. A refused request is sent again after `backoff_s`, not at once (a
tight loop of refusals would measure this process's CPU, not the gateway's fairness).

Records every request's outcome (its HTTP status, or the error that ended it) and when the
completed ones ended, for a completed-requests-per-second figure.
"""

import asyncio
import json
import time
from collections import Counter

import aiohttp

REQUEST_TIMEOUT_S = 600.0
PROMPT_WORD = "word "  # one token each in SmolLM2's tokenizer (and most BPE tokenizers)


class Flood:
    def __init__(self, base_url: str, model: str, source: str, prompt_tokens: int, max_tokens: int):
        self.url = f"{base_url}/v1/chat/completions"
        self.source = source
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT_WORD * prompt_tokens}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        self.body = json.dumps(body).encode()
        self.statuses: Counter = Counter()
        self.completed_at: list[float] = []  # monotonic

    async def run(self, concurrency: int, backoff_s: float, stop: asyncio.Event) -> None:
        connector = aiohttp.TCPConnector(limit=0, local_addr=(self.source, 0))
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            loops = [
                asyncio.create_task(self._loop(session, backoff_s, stop))
                for _ in range(concurrency)
            ]
            await stop.wait()
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _loop(self, session, backoff_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if await self._one(session) != "200":
                await asyncio.sleep(backoff_s)

    async def _one(self, session: aiohttp.ClientSession) -> str:
        try:
            headers = {"Content-Type": "application/json"}
            async with session.post(self.url, data=self.body, headers=headers) as reply:
                await reply.read()  # the whole event stream
                outcome = str(reply.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            outcome = type(err).__name__
        self.statuses[outcome] += 1
        if outcome == "200":
            self.completed_at.append(time.monotonic())
        return outcome

    def report(self, started: float, ended: float) -> dict:
        """Outcomes over the whole flood; completed requests per second between two instants."""
        inside = [t for t in self.completed_at if started <= t <= ended]
        return {
            "statuses": dict(self.statuses),
            "completed_per_s": len(inside) / max(ended - started, 1e-9),
        }
