from dataclasses import dataclass, field

from shared.control.worker_roles import Role
from shared.worker.settings import WorkerSettings


@dataclass
class DecodeSettings(WorkerSettings):
    """Settings of a decode worker (flags or TANDEM_* variables)."""

    colocated: bool = field(
        default=False,
        metadata={
            "help": "announce as a colocated worker: prefill and decode here, no KV transfer"
        },
    )

    @property
    def role(self) -> Role:
        return Role.COLOCATED if self.colocated else Role.DECODE
