"""Several async streams read as one: the items of each as they come, tagged with its index."""

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()
_CANCELLED = object()  # a stream's own cancellation (not this reader's): ends them all


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) from every stream until all have ended. The first error in any ends them
    all (each closed, so its cleanup runs) and is raised here; so is closing this one."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, _END))
        except Exception as err:  # ends the others; raised to the reader
            await queue.put((index, err))
        except BaseException:
            queue.put_nowait((index, _CANCELLED))
            raise

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        await asyncio.sleep(0)  # every stream started: closing one now runs its cleanup
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is _END:
                left -= 1
            elif item is _CANCELLED:
                raise asyncio.CancelledError()
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
