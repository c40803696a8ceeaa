"""Rooms: the workers a gateway may place a request on without asking (issue 49), as this
scheduler's heartbeat names them.

The scheduler stays the authority: it names rooms only while nothing waits in its queue (a
request placed directly then takes nothing a waiting one would have had), only for the prompts
it would prefill on the decode worker itself (at most `direct_prompt_tokens`; none when the mode
is disaggregated or a latency bound, --max-itl-ms, makes admission depend on step times), and
only what each worker had free at its last heartbeat, less what this scheduler has placed there
since. A gateway spends a room's seats and KV tokens as it places; the worker's own admission
is the last word (a worker that is full refuses, and the request goes through the scheduler).
The rooms are at most as fresh as the heartbeats: the next beat replaces them.
"""

from services.scheduler.registry import WorkerRegistry
from services.scheduler.roles import decode_roles
from services.scheduler.router import Policy
from shared.control.messages import Room
from shared.control.worker_roles import Mode

MAX_ROOMS = 64  # rooms named in one heartbeat, the roomiest first (a beat stays small)


def offer(
    registry: WorkerRegistry, policy: Policy, limit: int, queued: int
) -> tuple[list[Room], int]:
    """The workers with room now and the longest prompt a gateway may place on them itself
    (`limit` at most; 0: none), while nothing waits in the queue (`queued`)."""
    limit = _prompt_limit(policy, limit)
    return (_rooms(registry, policy), limit) if limit and not queued else ([], 0)


def _prompt_limit(policy: Policy, limit: int) -> int:
    if policy.mode == Mode.DISAGGREGATED or policy.max_itl_ms > 0:
        return 0
    if policy.mode == Mode.AUTO:  # longer prompts may be prefilled on a prefill worker
        return min(limit, policy.local_prefill_tokens)
    return limit


def _rooms(registry: WorkerRegistry, policy: Policy) -> list[Room]:
    roles = decode_roles(policy.mode)
    found = []
    for w in registry.live():
        seats = w.max_num_seqs - w.running - w.queued  # with what this scheduler placed since
        free_blocks = w.kv_blocks_total - w.kv_blocks_used
        if w.role in roles and not w.stopping and seats > 0 and free_blocks > 0:
            found.append(Room(w.worker_id, seats, free_blocks * max(1, w.block_size)))
    found.sort(key=lambda r: (-r.seats, -r.kv_tokens, r.worker_id))
    return found[:MAX_ROOMS]
