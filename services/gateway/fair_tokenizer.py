"""FairTokenizer: tokenization jobs run one at a time on one thread (a Hugging Face tokenizer is
not safe to call from several at once), taken from each client in turn.

A client that sends 64 large prompts at once waits behind its own jobs, not in front of everyone
else's: another client's job runs after at most the one in progress. Each job is bounded anyway
(validation refuses a prompt too long for the context by its size, before tokenizing it).

A small job (a short prompt: a fraction of a millisecond) finds the thread idle most of the time;
it then runs on the event loop at once instead (the thread is idle, so the tokenizer is still
used by one thread at a time): two thread hops cost more than the job itself.
"""

import asyncio
import concurrent.futures
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from shared.telemetry.request_log import detached


class FairTokenizer:
    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._waiting: OrderedDict[str, deque] = OrderedDict()  # client -> its jobs, in turn
        self._worker: asyncio.Task | None = None
        self._busy = False  # a job is on the thread now

    async def run(self, client: str, fn: Callable, *args, small: bool = False) -> Any:
        """fn(*args) on the tokenizer thread, in `client`'s turn; a `small` job on the event loop
        at once when no job runs or waits."""
        if small and not self._busy and not self._waiting:
            return fn(*args)
        done = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(client, deque()).append((fn, args, done))
        if self._worker is None or self._worker.done():
            self._worker = detached(self._work())  # serves every client's requests
        return await done

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            client, jobs = next(iter(self._waiting.items()))
            fn, args, done = jobs.popleft()
            if jobs:
                self._waiting.move_to_end(client)  # its next job waits for the others' turns
            else:
                del self._waiting[client]
            if done.done():  # its caller went away
                continue
            self._busy = True
            try:
                result = await loop.run_in_executor(self._executor, fn, *args)
            except Exception as err:
                if not done.done():
                    done.set_exception(err)
            else:
                if not done.done():
                    done.set_result(result)
            finally:
                self._busy = False

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
