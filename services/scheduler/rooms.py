"""Rooms: the workers a gateway may place a request on without asking (issue 49), as this
scheduler's heartbeat names them.

The scheduler stays the authority: it names rooms only while nothing waits in its queue (a
request placed directly then takes nothing a waiting one would have had), only for short prompts
(at most `direct_prompt_tokens`; in `auto` mode only those it would prefill on the decode worker
itself; none when a latency bound, --max-itl-ms, makes admission depend on step times), and only
what each worker had free at its last heartbeat, less what this scheduler has placed there since.

In disaggregated mode each decode worker's room names the prefill workers a request placed there
takes its prompt from: those with its KV layout and room in their queue (a place left, the
prompt work queued there within --max-prefill-wait-s), nearest by the cost model's topology
(same host, then zone, then anywhere), the cheapest pair for a prompt of the limit first; the
prefill workers' rooms are their queues' places left. A decode worker with no such partner has no
room (its requests go through the scheduler, whose fallback decides).

A gateway spends a room's seats and KV tokens as it places; the worker's own admission is the
last word (a worker that is full refuses, and the request goes through the scheduler). The rooms
are at most as fresh as the heartbeats: the next beat replaces them.
"""

from dataclasses import dataclass, field

from services.scheduler import capacity, cost
from services.scheduler.registry import WorkerRegistry
from services.scheduler.roles import decode_roles
from services.scheduler.router import Policy
from shared.control.messages import Room, WorkerHeartbeat
from shared.control.rules import MAX_PARTNERS
from shared.control.worker_roles import Mode, Role

MAX_ROOMS = 64  # rooms named in one heartbeat, the roomiest first (a beat stays small)
UNBOUNDED_SEATS = 1024  # a prefill worker that names no queue limit: places named at a time


@dataclass
class Offer:
    """What a heartbeat names: the rooms whose workers prefill their prompts themselves; in
    disaggregated mode instead the decode workers' rooms each naming its prefill workers
    (`paired_rooms`: apart, so that a gateway that does not know of pairs places nothing there),
    and those prefill workers' rooms; and the longest prompt a gateway may place itself (0:
    none)."""

    rooms: list[Room] = field(default_factory=list)
    paired_rooms: list[Room] = field(default_factory=list)
    prefill_rooms: list[Room] = field(default_factory=list)
    prompt_tokens: int = 0


def offer(registry: WorkerRegistry, policy: Policy, limit: int, queued: int) -> Offer:
    """The workers with room now and the longest prompt a gateway may place on them itself
    (`limit` at most), while nothing waits in the queue (`queued`)."""
    limit = _prompt_limit(policy, limit)
    if not limit or queued:
        return Offer()
    if policy.mode != Mode.DISAGGREGATED:
        rooms = [room for room, _ in _decode_rooms(registry, policy)]
        return Offer(rooms, prompt_tokens=limit)
    prefills = _prefill_rooms(registry, policy, limit)
    rooms = []
    for room, worker in _decode_rooms(registry, policy):
        room.prefill_workers = _partners(worker, prefills, limit)
        if room.prefill_workers:
            rooms.append(room)
    named = {p for room in rooms for p in room.prefill_workers}
    prefill_rooms = [_prefill_room(p) for p, _ in prefills if p.worker_id in named]
    return Offer([], rooms, prefill_rooms, limit) if rooms else Offer()


def _prompt_limit(policy: Policy, limit: int) -> int:
    if policy.max_itl_ms > 0:
        return 0
    if policy.mode == Mode.AUTO:  # longer prompts may be prefilled on a prefill worker
        return min(limit, policy.local_prefill_tokens)
    return limit


def _decode_rooms(registry: WorkerRegistry, policy: Policy) -> list[tuple[Room, WorkerHeartbeat]]:
    roles = decode_roles(policy.mode)
    found = []
    for w in registry.live():
        seats = w.max_num_seqs - w.running - w.queued  # with what this scheduler placed since
        free_blocks = w.kv_blocks_total - w.kv_blocks_used
        if w.role in roles and not w.stopping and seats > 0 and free_blocks > 0:
            found.append((Room(w.worker_id, seats, free_blocks * max(1, w.block_size)), w))
    found.sort(key=lambda rw: (-rw[0].seats, -rw[0].kv_tokens, rw[0].worker_id))
    return found[:MAX_ROOMS]


def _prefill_rooms(
    registry: WorkerRegistry, policy: Policy, limit: int
) -> list[tuple[WorkerHeartbeat, float]]:
    """The prefill workers that take a prompt of `limit` tokens now, each with its wait for one
    (its queued prompt work, then the prompt's own)."""
    return [
        (p, cost.prefill_wait_s(p, limit, limit))
        for p in registry.live(Role.PREFILL)
        if not p.stopping
        and capacity.takes(p, limit)
        and cost.prefill_wait_s(p, 0) <= policy.max_prefill_wait_s
    ]


def _partners(
    decode: WorkerHeartbeat, prefills: list[tuple[WorkerHeartbeat, float]], limit: int
) -> list[str]:
    """The prefill workers nearest `decode` by topology with its KV layout, cheapest pair first."""
    matching = [(p, wait) for p, wait in prefills if p.layout == decode.layout]
    if not matching:
        return []
    nearest = max(cost.bandwidth(p, decode) for p, _ in matching)
    priced = sorted(
        (wait + cost.transfer_s(p, decode, limit), p.worker_id)
        for p, wait in matching
        if cost.bandwidth(p, decode) == nearest
    )
    return [worker_id for _, worker_id in priced[:MAX_PARTNERS]]


def _prefill_room(p: WorkerHeartbeat) -> Room:
    held = p.running + p.queued
    seats = p.max_queue - held if p.max_queue else UNBOUNDED_SEATS
    return Room(p.worker_id, seats, p.kv_blocks_total * max(1, p.block_size), tp=p.tp)
