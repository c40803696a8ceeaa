"""An attempt: one placement of a request on the cluster, as a value.

A request may take several attempts. A scheduler that does not answer (it may have died holding
the request) or hands the request back (it is shutting down, or hears no worker) has it submitted
once more (a replica asked by name that hands it back holds nothing: the same attempt is asked of
the next replica, RequestRelay._ask_scheduler); a worker that fails, or turns it away as full,
has it moved: the next attempt goes on after the tokens the client already has (migration.resumed). Each attempt has its own id, the attempt_id of its
GenerateTask: a client cannot cancel another's stream by reusing its id, and a retry never
collides with the attempt it replaces.

Every transition returns a new Attempt and leaves the old one as it was; the GenerateTask inside
an attempt is never changed after it is made:

    Attempt(task)            unplaced: to be submitted
    placed(worker)           unplaced -> serving: a scheduler (or this gateway, in a room a
                             scheduler named: direct_rooms.py) put it on that decode worker
    received(chunk)          serving -> serving: the chunk it expected came
    resubmitted()            unplaced -> unplaced, under a new id: no scheduler placed it (once)
    moved(failure)           any -> unplaced, under a new id: its worker was lost (full or failed)
"""

import dataclasses
from collections.abc import Iterable, Iterator

from services.gateway.migration import client_id, new_attempt_id, resumed
from shared.control.failure import Failure, Retry
from shared.control.messages import GenerateTask, TokenChunk


class Sent:
    """The token ids a client has received, as a value: `plus` gives a new Sent and leaves this
    one as it was, in the time of the ids added (a tuple's `+` copies all of them: a stream's
    chunks cost their square). The newest Sent of a line extends the list it shares with the
    ones before it, each of which reads only its own length of it; extending one that is not the
    newest copies its ids first."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._ids = list(ids)
        self._n = len(self._ids)

    def plus(self, ids: Iterable[int]) -> "Sent":
        shared = self._ids if len(self._ids) == self._n else self._ids[: self._n]
        shared.extend(ids)
        after = object.__new__(Sent)
        after._ids, after._n = shared, len(shared)
        return after

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids[: self._n])

    def __eq__(self, other) -> bool:
        if isinstance(other, Sent | tuple | list):
            return len(other) == self._n and list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Sent({list(self)!r})"


@dataclasses.dataclass(frozen=True)
class Attempt:
    task: GenerateTask  # what is submitted; task.attempt_id is this attempt's id
    worker: str = ""  # the decode worker serving it; "" until placed
    # the output the client has received, over every attempt
    sent: Sent = dataclasses.field(default_factory=Sent)
    expected: int = 0  # the index of the next chunk of this attempt's stream
    full_moves: int = 0  # times the request moved off a full worker, Retry.HERE (limit: FULL_MOVES)
    failed_moves: int = 0  # times it moved off a failed one, Retry.ELSEWHERE (--max-migrations)
    resubmission: bool = False  # submitted once more after no scheduler placed the one before
    moved_because: str | None = None  # the failure that moved the request here; None: never moved

    @property
    def id(self) -> str:
        """The attempt id (task.attempt_id): the client's request id and a random part."""
        return self.task.attempt_id

    @property
    def prompt(self) -> list[int]:
        """The request's own prompt, without the output an earlier attempt produced."""
        ids = self.task.prompt_token_ids
        return ids[: len(ids) - self.task.resume_tokens]

    def moves(self, retry: Retry) -> int:
        """Times the request moved for this reason: off a full worker (Retry.HERE), or off a failed
        one (Retry.ELSEWHERE)."""
        return self.full_moves if retry is Retry.HERE else self.failed_moves

    def placed(self, worker: str) -> "Attempt":
        if self.worker:
            raise ValueError(f"{self.id} is already placed on {self.worker}")
        return dataclasses.replace(self, worker=worker)

    def received(self, *chunks: TokenChunk) -> "Attempt":
        """The attempt after the client got `chunks` (the next ones of its stream, in order)."""
        expected, ids = self.expected, []
        for chunk in chunks:
            if not self.worker or chunk.index != expected:
                raise ValueError(f"{self.id} expects chunk {expected} from {self.worker or '?'}")
            expected += 1
            ids += chunk.token_ids
        # as dataclasses.replace, without its __init__ or copy's protocol (once per answer:
        # ~1 us instead of ~4)
        after = object.__new__(Attempt)
        state = after.__dict__
        state.update(self.__dict__)
        state["sent"] = self.sent.plus(ids)
        state["expected"] = expected
        return after

    def resubmitted(self) -> "Attempt":
        if self.worker or self.resubmission:
            raise ValueError(f"{self.id} is not to be submitted again")
        task = dataclasses.replace(self.task, attempt_id=new_attempt_id(client_id(self.id)))
        return dataclasses.replace(self, task=task, resubmission=True)

    def moved(self, failure: Failure) -> "Attempt":
        """The next attempt: the prompt and the output sent so far, what is left to generate,
        the failed worker avoided (not a full one)."""
        if not failure.movable:
            raise ValueError(f"{self.id} cannot move for {failure}")
        full = failure.retry is Retry.HERE
        return Attempt(
            task=resumed(self.task, self.prompt, list(self.sent), failure.avoid),
            sent=self.sent,
            full_moves=self.full_moves + full,
            failed_moves=self.failed_moves + (not full),
            moved_because=failure.message,
        )
