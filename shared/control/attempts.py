"""What a message about one attempt of a request declares: the attempt's id. The bus names it in
its handler's log lines (shared.control.bus), asking `isinstance(message, AboutAnAttempt)`.

Every such message in shared.control.messages derives from one of these: a message with an
`attempt_id` field from AboutAnAttempt; one that carries the request itself (its `task` field, a
GenerateTask) from AboutATask, whose attempt is the task's.
"""

from typing import Any


class AboutAnAttempt:
    """A message about one attempt of a request."""

    attempt_id: str


class AboutATask(AboutAnAttempt):
    """A message that carries the request it is about: its attempt is the task's."""

    task: Any  # the message's own field, a GenerateTask (messages.py imports this module)

    @property
    def attempt_id(self) -> str:
        return self.task.attempt_id
