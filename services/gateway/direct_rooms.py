"""DirectRooms: the workers the schedulers' heartbeats name as having room
(services/scheduler/rooms.py), spent as this gateway places requests on them itself: one NATS
hop and a scheduler's turn fewer for a request (issue 49).

A request goes straight to a worker only when: this gateway places directly at all
(--direct-placement); every scheduler replica that accepts submissions and was heard within
`fresh_s` has nothing waiting in its queue (a direct placement then takes nothing a waiting
request would have had); the request is one choice's first attempt (not moved, resumed or
submitted again, no worker to avoid) and its prompt is within the beat's direct_prompt_tokens;
and a room heard within `fresh_s` has a seat and KV tokens for its prompt and max new tokens
(disaggregated: and one of the prefill workers the room names has a place in its queue and holds
the prompt). The roomiest is taken and spent here (of its prefill workers, the one with the most
places left; the cheapest pair on a tie), so a burst does not all land on one worker, and given
back when the request ends (short requests reuse a seat many times between beats); the next beat
replaces the rooms with the scheduler's new view. A worker that turns a request away (full,
draining, gone, silent) is offered no more until a beat names it again; the request then goes
through the scheduler, as every other does.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.control.messages import GenerateTask, Room, SchedulerHeartbeat


@dataclass(frozen=True)
class Placement:
    """Where a request placed directly goes: its decode worker, and the prefill worker that
    computes its prompt ("": the decode worker does), of `prefill_tp` ranks."""

    decode: str
    prefill: str = ""
    prefill_tp: int = 1


class _Left:
    """What a named room has left here."""

    __slots__ = ("seats", "kv_tokens", "prefill_workers", "tp")

    def __init__(self, room: Room) -> None:
        self.seats, self.kv_tokens = room.seats, room.kv_tokens
        self.prefill_workers, self.tp = tuple(room.prefill_workers), room.tp


class DirectRooms:
    def __init__(self, enabled: bool, fresh_s: float, clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self._fresh_s = fresh_s
        self._clock = clock
        self._rooms: dict[str, _Left] = {}  # decode worker id -> what its room has left
        self._prefill: dict[str, _Left] = {}  # prefill worker id -> places left in its queue
        self._named_by = ""  # the replica whose beat named them
        self._limit = 0  # the longest prompt the last beat allows
        self._heard = float("-inf")  # when the rooms were named
        self._queues: dict[str, tuple[int, float]] = {}  # accepting replica -> (queued, heard)
        self.placed = 0  # requests this gateway placed itself
        self.turned = 0  # ... that a worker did not take (then placed by a scheduler)

    def heard(self, beat: SchedulerHeartbeat) -> None:
        """A scheduler's heartbeat: its queue, and the rooms it names now (none: none)."""
        now = self._clock()
        if beat.accepting and not beat.stopping:
            self._queues[beat.scheduler_id] = (beat.queued, now)
        else:  # standing aside or leaving: it holds no waiting request, and what it named goes
            self._queues.pop(beat.scheduler_id, None)  # (an accepting replica names it again)
            if beat.scheduler_id == self._named_by:
                self._rooms, self._prefill, self._limit = {}, {}, 0
            return
        self._rooms = {r.worker_id: _Left(r) for r in [*beat.rooms, *beat.paired_rooms]}
        self._prefill = {r.worker_id: _Left(r) for r in beat.prefill_rooms}
        self._limit, self._heard, self._named_by = beat.direct_prompt_tokens, now, beat.scheduler_id

    def take(self, task: GenerateTask) -> Placement | None:
        """Where to place `task` directly, its rooms spent; None when it goes through a
        scheduler."""
        now = self._clock()
        if not self._eligible(task) or now - self._heard > self._fresh_s:
            return None
        if any(queued for queued, heard in self._queues.values() if now - heard <= self._fresh_s):
            return None  # a request waits for room: this one queues behind it, at a scheduler
        prompt = len(task.prompt_token_ids)
        need = prompt + task.sampling.max_tokens
        best, room, prefill = "", None, ""
        for worker_id, left in self._rooms.items():
            if left.seats <= 0 or left.kv_tokens < need:
                continue
            if room is not None and (left.seats, left.kv_tokens) <= (room.seats, room.kv_tokens):
                continue
            partner = self._partner(left, prompt)
            if partner is not None:
                best, room, prefill = worker_id, left, partner
        if room is None:
            return None
        room.seats -= 1
        room.kv_tokens -= need
        if prefill:
            self._prefill[prefill].seats -= 1
        self.placed += 1
        tp = self._prefill[prefill].tp if prefill else 1
        return Placement(best, prefill, tp)

    def _partner(self, room: _Left, prompt: int) -> str | None:
        """The prefill worker for a prompt placed in `room` ("": the room prefills it itself);
        None when each it names is full or gone."""
        if not room.prefill_workers:
            return ""
        best, most = None, 0
        for worker_id in room.prefill_workers:  # the cheapest pair first: it wins a tie
            left = self._prefill.get(worker_id)
            if left is not None and left.seats > most and left.kv_tokens >= prompt:
                best, most = worker_id, left.seats
        return best

    def returned(self, placement: Placement, task: GenerateTask) -> None:
        """A request placed directly ended: its seats and KV tokens are free again (in the rooms
        named since, as in those it was taken from: a beat counts what runs)."""
        room = self._rooms.get(placement.decode)
        if room is not None:
            room.seats += 1
            room.kv_tokens += len(task.prompt_token_ids) + task.sampling.max_tokens
        prefill = self._prefill.get(placement.prefill)
        if prefill is not None:
            prefill.seats += 1

    def turned_away(self, worker_id: str) -> None:
        """A worker did not take a request placed on it (full, draining, gone, silent): no
        room there until a beat names it again."""
        self._rooms.pop(worker_id, None)
        self._prefill.pop(worker_id, None)
        self.turned += 1

    def _eligible(self, task: GenerateTask) -> bool:
        return (
            self.enabled
            and task.sampling.n == 1
            and not (task.resume_tokens or task.avoid_workers or task.moves)
            and len(task.prompt_token_ids) <= self._limit
        )
