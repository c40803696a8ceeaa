"""DirectRooms: the workers the schedulers' heartbeats name as having room
(services/scheduler/rooms.py), spent as this gateway places requests on them itself: one NATS
hop and a scheduler's turn fewer for a request (issue 49).

A request goes straight to a worker only when: this gateway places directly at all
(--direct-placement); every scheduler replica that accepts submissions and was heard within
`fresh_s` has nothing waiting in its queue (a direct placement then takes nothing a waiting
request would have had); the request is one choice's first attempt (not moved, resumed or
submitted again, no worker to avoid) and its prompt is within the beat's direct_prompt_tokens;
and a room heard within `fresh_s` has a seat and KV tokens for its prompt and max new tokens.
The roomiest is taken and spent here, so a burst does not all land on one worker, and given back
when the request ends (short requests reuse a seat many times between beats); the next beat
replaces the rooms with the scheduler's new view. A worker that turns a request away (full,
draining, gone, silent) is offered no more until a beat names it again; the request then goes
through the scheduler, as every other does.
"""

import time
from collections.abc import Callable

from shared.control.messages import GenerateTask, SchedulerHeartbeat


class DirectRooms:
    def __init__(self, enabled: bool, fresh_s: float, clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self._fresh_s = fresh_s
        self._clock = clock
        self._rooms: dict[str, list[int]] = {}  # worker id -> [seats, KV tokens] left
        self._named_by = ""  # the replica whose beat named them
        self._limit = 0  # the longest prompt the last beat allows
        self._heard = float("-inf")  # when the rooms were named
        self._queues: dict[str, tuple[int, float]] = {}  # accepting replica -> (queued, heard)
        self.placed = 0  # requests this gateway placed itself
        self.refused = 0  # ... that the worker did not take (then placed by a scheduler)

    def heard(self, beat: SchedulerHeartbeat) -> None:
        """A scheduler's heartbeat: its queue, and the rooms it names now (none: none)."""
        now = self._clock()
        if beat.accepting and not beat.stopping:
            self._queues[beat.scheduler_id] = (beat.queued, now)
        else:  # standing aside or leaving: it holds no waiting request, and what it named goes
            self._queues.pop(beat.scheduler_id, None)  # (an accepting replica names it again)
            if beat.scheduler_id == self._named_by:
                self._rooms, self._limit = {}, 0
            return
        self._rooms = {r.worker_id: [r.seats, r.kv_tokens] for r in beat.rooms}
        self._limit, self._heard, self._named_by = beat.direct_prompt_tokens, now, beat.scheduler_id

    def take(self, task: GenerateTask) -> str:
        """The worker to place `task` on directly, its room spent; "" when it goes through a
        scheduler."""
        now = self._clock()
        if not self._eligible(task) or now - self._heard > self._fresh_s:
            return ""
        if any(queued for queued, heard in self._queues.values() if now - heard <= self._fresh_s):
            return ""  # a request waits for room: this one queues behind it, at a scheduler
        need = len(task.prompt_token_ids) + task.sampling.max_tokens
        best, room = "", None
        for worker_id, left in self._rooms.items():
            if left[0] > 0 and left[1] >= need and (room is None or left > room):
                best, room = worker_id, left
        if room is None:
            return ""
        room[0] -= 1
        room[1] -= need
        self.placed += 1
        return best

    def returned(self, worker_id: str, task: GenerateTask) -> None:
        """A request placed directly ended on its worker: its seat and KV tokens are free again
        (in the rooms named since, as in those it was taken from: a beat counts what runs)."""
        room = self._rooms.get(worker_id)
        if room is not None:
            room[0] += 1
            room[1] += len(task.prompt_token_ids) + task.sampling.max_tokens

    def turned_away(self, worker_id: str) -> None:
        """The worker did not take a request placed on it (full, draining, gone, silent)."""
        self._rooms.pop(worker_id, None)
        self.refused += 1

    def _eligible(self, task: GenerateTask) -> bool:
        return (
            self.enabled
            and task.sampling.n == 1
            and not (task.resume_tokens or task.avoid_workers or task.moves)
            and len(task.prompt_token_ids) <= self._limit
        )
