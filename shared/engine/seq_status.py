"""SeqStatus: a sequence's one status, and the one table it moves through.

Whether a sequence is done, and why, is its status: FINISHED_STOPPED (an end-of-sequence token or
a stop string), FINISHED_LENGTH (max_tokens or the model's length; a prefill's one token) or
FINISHED_ABORTED (cancelled, failed or expired: its owner knows the cause). Only code in
shared.engine moves it (the Sequence as it samples, the Scheduler as it places it, the Engine as
its owner ends it), and only along MOVES: any other move raises IllegalMove.
"""

import enum


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # its prompt (or part of it) to compute here
    WAITING_KV = "waiting_kv"  # its blocks reserved; its prompt computed on a prefill worker
    KV_READY = "kv_ready"  # the remote KV landed in its blocks; it joins the batch
    RUNNING = "running"  # decoding: a token each step
    PREEMPTED = "preempted"  # its blocks were taken back; its tokens are computed again later
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES  # (a str's hash is kept; an Enum's is Python's)


_FINISHED = frozenset(
    {SeqStatus.FINISHED_STOPPED, SeqStatus.FINISHED_LENGTH, SeqStatus.FINISHED_ABORTED}
)
_FINISHED_VALUES = frozenset(status.value for status in _FINISHED)
S = SeqStatus
MOVES: dict[SeqStatus, frozenset[SeqStatus]] = {
    # a sequence that samples a token (from WAITING, KV_READY, RUNNING) may finish there
    S.WAITING: frozenset({S.WAITING_KV, S.RUNNING}) | _FINISHED,  # its first token: on, or done
    S.WAITING_KV: frozenset({S.KV_READY, S.FINISHED_ABORTED}),
    S.KV_READY: frozenset({S.RUNNING}) | _FINISHED,
    S.RUNNING: frozenset({S.PREEMPTED}) | _FINISHED,
    S.PREEMPTED: frozenset({S.WAITING, S.FINISHED_ABORTED}),  # WAITING: its blocks back
    S.FINISHED_STOPPED: frozenset(),
    S.FINISHED_LENGTH: frozenset(),
    S.FINISHED_ABORTED: frozenset(),
}


class IllegalMove(RuntimeError):
    """A status move MOVES does not allow: a bug in whoever asked for it."""


def checked(current: SeqStatus, to: SeqStatus) -> SeqStatus:
    """`to`, when a sequence in `current` may move there (else IllegalMove)."""
    if to not in MOVES[current]:
        raise IllegalMove(f"a {current.name} sequence cannot become {to.name}")
    return to
