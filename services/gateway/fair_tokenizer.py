"""FairTokenizer: tokenization jobs run one at a time on one thread (a Hugging Face tokenizer is
not safe to call from several at once), taken from each client in turn.

A client that sends 64 large prompts at once waits behind its own jobs, not in front of everyone
else's: another client's job runs after at most the one in progress. Each job is bounded anyway
(validation refuses a prompt too long for the context by its size, and one of too many messages by
their count, before rendering or tokenizing it). What a job costs is only known once it ran (a
request of 36,000 empty messages is a few characters), and every stream, health check and NATS
callback waits while the loop is busy: only a request whose cost is bounded small by its shape
(validation.light: a few messages, a few hundred characters, no tools or grammar; at most ~0.5 ms)
is validated on the loop instead, where it costs less than the hand-off to this thread and back.
"""

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from shared.job_thread import JobThread
from shared.telemetry.request_log import detached


class FairTokenizer:
    def __init__(self) -> None:
        self._thread = JobThread("tokenize")
        self._waiting: OrderedDict[str, deque] = OrderedDict()  # client -> its jobs, in turn
        self._worker: asyncio.Task | None = None

    async def run(self, client: str, fn: Callable, *args) -> Any:
        """fn(*args) on the tokenizer thread, in `client`'s turn."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(client, deque()).append((fn, args, done))
        if self._worker is None or self._worker.done():
            self._worker = detached(self._work())  # serves every client's requests
        return await done

    async def _work(self) -> None:
        while self._waiting:
            client, jobs = next(iter(self._waiting.items()))
            fn, args, done = jobs.popleft()
            if jobs:
                self._waiting.move_to_end(client)  # its next job waits for the others' turns
            else:
                del self._waiting[client]
            if done.done():  # its caller went away
                continue
            try:
                result = await self._thread.run(fn, *args)
            except Exception as err:
                if not done.done():
                    done.set_exception(err)
            else:
                if not done.done():
                    done.set_result(result)

    def close(self) -> None:
        self._thread.close()
