"""The scheduler's answer to a status request: a page of slim worker statuses, sorted by id."""

import dataclasses

from shared.control.messages import StatusReply, StatusRequest, WorkerHeartbeat, WorkerStatus
from shared.control.worker_roles import Mode

STATUS_PAGE = 128  # workers per status reply: within the wire cap whatever their labels


def worker_status(beat: WorkerHeartbeat) -> WorkerStatus:
    """What ClusterStatus shows of a worker: its heartbeat without what only routing needs."""
    return WorkerStatus(**{f.name: getattr(beat, f.name) for f in dataclasses.fields(WorkerStatus)})


def status_page(
    live: list[WorkerHeartbeat], request: StatusRequest, mode: Mode, ready: bool, dropped: int
) -> StatusReply:
    """The workers after `request.after` (live is sorted by id), `request.limit` at most."""
    after = [w for w in live if w.worker_id > request.after]
    page = after[: min(request.limit, STATUS_PAGE)]
    return StatusReply(
        mode=mode,
        ready=ready,
        workers=[worker_status(w) for w in page],
        messages_dropped=dropped,
        more=len(after) > len(page),
    )
