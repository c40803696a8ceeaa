"""Asking the schedulers' queue group for the cluster's status (ClusterStatus, readiness).

A scheduler cut off from the cluster keeps its subscription on its NATS server until the server
gives it up (~6 s with Tandem's config; minutes with nats-server's default), and a request the
server hands to it goes unanswered. Such a request is asked again: the queue group hands it to
another member. Nobody listening at all is not asked again.
"""

from shared.control.bus import BusError, MessageBus, NoResponders
from shared.control.messages import StatusReply, StatusRequest
from shared.control.subjects import Subjects

ASKS = 3  # a status request is asked at most this many times
MAX_WAIT_S = 2.0  # an ask's wait for its answer, at most


def ask_wait(left_s: float | None) -> float:
    """An ask's wait when the caller has `left_s` (None: no deadline): all the asks fit in it,
    with a share to spare for the answer to go out."""
    return MAX_WAIT_S if left_s is None else max(0.05, min(MAX_WAIT_S, left_s / (ASKS + 1)))


async def ask_status(
    bus: MessageBus, subjects: Subjects, ask: StatusRequest, timeout_s: float, asks: int = ASKS
) -> StatusReply:
    """One scheduler's answer; BusError when `asks` tries went unanswered (NoResponders at once
    when no scheduler listens)."""
    for _ in range(asks - 1):
        try:
            return await bus.request(subjects.status, ask, timeout_s, StatusReply)
        except NoResponders:
            raise
        except BusError:
            continue  # unanswered: the queue group hands the next ask to another member
    return await bus.request(subjects.status, ask, timeout_s, StatusReply)


async def status_pages(
    bus: MessageBus, subjects: Subjects, page_size: int, timeout_s: float
) -> list[StatusReply]:
    """Every page of the cluster's status, in worker id order; BusError when a page went
    unanswered."""
    pages, after = [], ""
    while not pages or (pages[-1].more and pages[-1].workers):
        ask = StatusRequest(after=after, limit=page_size)
        pages.append(await ask_status(bus, subjects, ask, timeout_s))
        after = pages[-1].workers[-1].worker_id if pages[-1].workers else after
    return pages
