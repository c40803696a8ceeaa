"""A status request a cut-off scheduler swallows is asked again, and another one answers; nobody
listening is not asked again."""

import pytest

from services.gateway.status_asks import ASKS, MAX_WAIT_S, ask_status, ask_wait, status_pages
from shared.control.bus import NoResponders, RequestTimeout
from shared.control.messages import StatusReply, StatusRequest, WorkerStatus
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus

SUBJECTS = Subjects("default")
WAIT_S = 0.05


class Scheduler:
    """A member of the schedulers' queue group: answers pages of `workers`, or (cut off) never."""

    def __init__(self, workers: list[str], answers: bool = True):
        self.workers, self.answers, self.asked = workers, answers, 0

    async def on_status(self, ask: StatusRequest, respond) -> None:
        self.asked += 1
        if not self.answers:
            return
        after = [w for w in self.workers if w > ask.after][: ask.limit]  # 0: readiness only
        more = bool(after) and after[-1] != self.workers[-1]
        page = [WorkerStatus(worker_id=w, role="decode", host="h", pid=1) for w in after]
        await respond(StatusReply(mode="disaggregated", ready=True, workers=page, more=more))


async def group(*members: Scheduler) -> InMemoryBus:
    bus = InMemoryBus()
    for member in members:
        await bus.subscribe(SUBJECTS.status, member.on_status, queue="schedulers")
    return bus


async def test_a_request_the_cut_off_scheduler_swallows_is_answered_by_another():
    cut_off, live = Scheduler([], answers=False), Scheduler(["w1"])
    bus = await group(cut_off, live)
    reply = await ask_status(bus, SUBJECTS, StatusRequest(limit=8), WAIT_S)
    assert [w.worker_id for w in reply.workers] == ["w1"] and reply.ready
    assert (cut_off.asked, live.asked) == (1, 1)


async def test_every_page_is_asked_again_until_answered():
    workers = [f"w{i:02d}" for i in range(10)]
    cut_off, live = Scheduler([], answers=False), Scheduler(workers)
    bus = await group(cut_off, live)
    pages = await status_pages(bus, SUBJECTS, 3, WAIT_S)
    assert [w.worker_id for page in pages for w in page.workers] == workers
    assert live.asked == len(pages) == 4 and cut_off.asked == 4  # every page met it once


async def test_unanswered_asks_end_with_the_timeout_after_three_and_nobody_at_once():
    cut_off = Scheduler([], answers=False)
    bus = await group(cut_off)
    with pytest.raises(RequestTimeout):
        await ask_status(bus, SUBJECTS, StatusRequest(), WAIT_S)
    assert cut_off.asked == 3
    with pytest.raises(NoResponders):
        await ask_status(InMemoryBus(), SUBJECTS, StatusRequest(), WAIT_S)


def test_every_ask_fits_in_the_callers_deadline():
    assert ask_wait(None) == MAX_WAIT_S and ask_wait(100.0) == MAX_WAIT_S
    assert ask_wait(0.8) * ASKS < 0.8 and ask_wait(0.8) == pytest.approx(0.2)
    assert ask_wait(0.0) == 0.05  # past its deadline: one short ask, then the call ends
