"""AdmissionQueue: requests waiting for room, highest priority first, first come first served
among equals. Bounded in length and in waiting time, so overload is refused quickly (with a
retry-after hint) instead of queueing without end.
"""

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shared.messages import GenerateTask


@dataclass(order=True)
class Pending:
    sort_key: tuple = field(init=False, repr=False)
    priority: int = field(compare=False)
    order: int = field(compare=False)
    task: GenerateTask = field(compare=False)
    respond: Any = field(compare=False)          # how to answer the gateway; None when nobody waits
    enqueued_at: float = field(compare=False)
    tried: set = field(default_factory=set, compare=False)   # workers that refused it
    attempts: int = field(default=0, compare=False)
    refusal: tuple[str, str] | None = field(default=None, compare=False)   # the last worker's (code, message)

    def __post_init__(self) -> None:
        self.sort_key = (-self.priority, self.order)


class AdmissionQueue:
    def __init__(self, max_pending: int, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self._clock = clock
        self._heap: list[Pending] = []
        self._order = itertools.count()
        self._rate = 0.0            # requests leaving the queue for a worker per second, smoothed
        self._last_left = 0.0

    def __len__(self) -> int:
        return len(self._heap)

    def offer(self, task: GenerateTask, respond) -> Pending | None:
        """Queues the task; None when the queue is full (refuse it)."""
        if len(self._heap) >= self.max_pending:
            return None
        entry = Pending(task.priority, next(self._order), task, respond, self._clock())
        heapq.heappush(self._heap, entry)
        return entry

    def requeue(self, entry: Pending) -> None:
        """Back in its old place (a worker refused it after it was placed)."""
        heapq.heappush(self._heap, entry)

    def head(self) -> Pending | None:
        return self._heap[0] if self._heap else None

    def pop(self) -> Pending:
        """The head leaves for a worker."""
        now = self._clock()
        if self._last_left:
            gap = max(1e-3, now - self._last_left)
            self._rate = 1 / gap if not self._rate else 0.9 * self._rate + 0.1 / gap
        self._last_left = now
        return heapq.heappop(self._heap)

    def take(self) -> Pending:
        """The head leaves without a worker (refused or failed)."""
        return heapq.heappop(self._heap)

    def expired(self) -> list[Pending]:
        """Takes out every entry that waited longer than the timeout."""
        now = self._clock()
        late = [e for e in self._heap if now - e.enqueued_at > self.timeout_s]
        if late:
            self._heap = [e for e in self._heap if now - e.enqueued_at <= self.timeout_s]
            heapq.heapify(self._heap)
        return late

    def retry_after_ms(self) -> int:
        """When room is likely: the queue ahead drained at the recent rate, within [0.2 s, 30 s]."""
        if not self._rate:
            return 1000
        return int(min(30.0, max(0.2, (len(self._heap) + 1) / self._rate)) * 1000)
