"""TransferMachine: the scaffolding both KV transfer state machines share.

A machine has a state enum and a table of the moves each state allows; `_to` makes a move and
raises IllegalTransition on one the table does not allow (a bug in whoever drove the transfer).
A subclass names its table and reacts to a move in `_moved` (free blocks, wake a waiter).
"""

import enum
from collections.abc import Mapping
from typing import ClassVar, Generic, TypeVar

State = TypeVar("State", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """A transition the table does not allow: a bug in whoever drove the transfer."""


class TransferMachine(Generic[State]):
    ALLOWED: ClassVar[Mapping]  # state -> the states it may move to, for every state

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        states = {type(state) for state in cls.ALLOWED}
        kind = states.pop() if len(states) == 1 else None
        if (
            kind is None
            or set(cls.ALLOWED) != set(kind)
            or not all(set(targets) <= set(kind) for targets in cls.ALLOWED.values())
        ):
            raise TypeError(f"{cls.__name__}: ALLOWED must map every state of one enum")

    def __init__(self, attempt_id: str, initial: State):
        self.attempt_id = attempt_id
        self.state = initial

    def _to(self, state: State) -> None:
        if state not in self.ALLOWED[self.state]:
            raise IllegalTransition(f"{self.attempt_id}: {self.state.name} -> {state.name}")
        before, self.state = self.state, state
        self._moved(before, state)

    def _moved(self, before: State, after: State) -> None:
        """Called after each move."""
