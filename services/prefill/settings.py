from dataclasses import dataclass

from shared.control.worker_roles import Role
from shared.worker.settings import WorkerSettings


@dataclass
class PrefillSettings(WorkerSettings):
    """Settings of a prefill worker (flags or TANDEM_* variables)."""

    @property
    def role(self) -> Role:
        return Role.PREFILL
