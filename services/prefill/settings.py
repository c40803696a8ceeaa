from dataclasses import dataclass

from shared.worker.settings import WorkerSettings


@dataclass
class PrefillSettings(WorkerSettings):
    """Settings of a prefill worker (flags or TANDEM_* variables)."""

    @property
    def role(self) -> str:
        return "prefill"
