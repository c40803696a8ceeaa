"""AdmissionQueue: requests waiting for room, highest priority first; among equals, each client
in turn (start-time fair queueing: a client's next request is stamped one turn after its last
one, or after the turn now served, whichever is later), so a client that floods the queue waits
behind itself. Bounded in length and in waiting time, so overload is refused quickly (with a
retry-after hint) instead of queueing without end. The length bound is shared max-min fairly
(shared.control.fair_share): a lone client may fill the queue; when it is full, a client holding
less than its share is still let in (the queue runs over its bound by at most the newcomers'
shares), and one holding more is refused.

A request placed again (its worker failed, or was full; its client may be mid-stream) was admitted
already: it goes ahead of new requests of its priority, and a full queue does not turn it away.
"""

import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.control.failure import Failure
from shared.control.fair_share import within_share
from shared.control.messages import GenerateTask

RATE_WINDOW_S = 10.0


@dataclass(order=True)
class Pending:
    sort_key: tuple = field(init=False, repr=False)
    priority: int = field(compare=False)
    order: int = field(compare=False)
    task: GenerateTask = field(compare=False)
    respond: Any = field(compare=False)  # how to answer the gateway; None when nobody waits
    enqueued_at: float = field(compare=False)
    tried: set = field(default_factory=set, compare=False)  # workers that refused or failed it
    attempts: int = field(default=0, compare=False)
    turn: int = field(default=0, compare=False)  # its client's turn among its priority's
    skipped: int = field(default=0, compare=False)  # times requests behind it went first
    # how the last worker it was offered to refused it: said if no other one takes it
    failure: Failure | None = field(default=None, compare=False)
    trace: Any = field(default=None, compare=False)  # its trace context (the gateway's submit)

    def __post_init__(self) -> None:
        self.sort_key = (-self.priority, 0 if self.task.moves else 1, self.turn, self.order)


class AdmissionQueue:
    def __init__(
        self, max_pending: int, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self._clock = clock
        self._heap: list[Pending] = []
        self._order = itertools.count()
        self._placed: deque[float] = deque()  # when requests were placed, the last RATE_WINDOW_S
        self._serving: dict[int, int] = {}  # priority -> the turn served last
        self._last_turn: dict[tuple[int, str], int] = {}  # (priority, client) -> its last turn
        self._waiting: Counter[str] = Counter()  # by client: its requests in the queue

    def __len__(self) -> int:
        return len(self._heap)

    def priorities(self) -> list[int]:
        """The priority of each request waiting."""
        return [entry.priority for entry in self._heap]

    def offer(self, task: GenerateTask, respond) -> Pending | None:
        """Queues the task; None when the queue is full and its client holds its share (refuse it)."""
        if len(self._heap) >= self.max_pending and not task.moves and not self._within_share(task):
            return None
        entry = Pending(
            task.priority,
            next(self._order),
            task,
            respond,
            self._clock(),
            set(task.avoid_workers),
            turn=self._next_turn(task),
        )
        self._push(entry)
        return entry

    def _within_share(self, task: GenerateTask) -> bool:
        mine = self._waiting[task.client]
        others = [n for client, n in self._waiting.items() if client != task.client]
        return within_share(mine, self.max_pending, others)

    def _push(self, entry: Pending) -> None:
        heapq.heappush(self._heap, entry)
        self._waiting[entry.task.client] += 1

    def _left(self, entries) -> None:
        for entry in entries:
            self._waiting[entry.task.client] -= 1
            if self._waiting[entry.task.client] <= 0:
                del self._waiting[entry.task.client]

    def _next_turn(self, task: GenerateTask) -> int:
        key = (task.priority, task.client)
        serving = self._serving.get(task.priority, 0)
        turn = max(serving, self._last_turn.get(key, 0)) + 1
        self._last_turn[key] = turn
        if len(self._last_turn) > 4 * self.max_pending:  # forget clients with nothing waiting
            self._last_turn = {
                k: t for k, t in self._last_turn.items() if t > self._serving.get(k[0], 0)
            }
        return turn

    def requeue(self, entry: Pending) -> None:
        """Back in its old place (a worker refused it after it was placed)."""
        self._push(entry)

    def head(self) -> Pending | None:
        return self._heap[0] if self._heap else None

    def first(self, count: int) -> list[Pending]:
        """The first `count` entries, in order."""
        return heapq.nsmallest(count, self._heap)

    def pop(self) -> Pending:
        """The head leaves the queue (for a worker, or refused)."""
        return self.take(self._heap[0])

    def take(self, entry: Pending) -> Pending:
        """An entry leaves the queue (for a worker, or refused): its turn is being served."""
        if self._heap and self._heap[0] is entry:
            heapq.heappop(self._heap)
        else:
            self._heap.remove(entry)
            heapq.heapify(self._heap)
        self._serving[entry.priority] = max(self._serving.get(entry.priority, 0), entry.turn)
        self._left([entry])
        return entry

    def placed(self) -> None:
        """A request was accepted by a worker: counts toward the rate the queue drains at."""
        now = self._clock()
        self._placed.append(now)
        while self._placed and now - self._placed[0] > RATE_WINDOW_S:
            self._placed.popleft()

    def remove(self, attempt_id: str) -> Pending | None:
        """Takes a waiting request out (its client cancelled it); None when it is not waiting here."""
        entry = next((e for e in self._heap if e.task.attempt_id == attempt_id), None)
        if entry is not None:
            self._heap.remove(entry)
            heapq.heapify(self._heap)
            self._left([entry])
        return entry

    def expired(self) -> list[Pending]:
        """Takes out every entry that waited longer than the timeout."""
        now = self._clock()
        late = [e for e in self._heap if now - e.enqueued_at > self.timeout_s]
        if late:
            self._heap = [e for e in self._heap if now - e.enqueued_at <= self.timeout_s]
            heapq.heapify(self._heap)
            self._left(late)
        return late

    def retry_after_ms(self) -> int:
        """When room is likely: the queue ahead drained at the rate requests were placed over the
        last RATE_WINDOW_S, within [0.2 s, 30 s]; 1 s before anything was placed."""
        now = self._clock()
        recent = [t for t in self._placed if now - t <= RATE_WINDOW_S]
        if not recent:
            return 1000
        rate = len(recent) / max(1.0, now - recent[0])
        return round(min(30.0, max(0.2, (len(self._heap) + 1) / rate)) * 1000)
