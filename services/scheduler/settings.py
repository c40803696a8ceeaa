from dataclasses import dataclass, field

from shared.settings import CommonSettings

MODES = ("disaggregated", "colocated")


@dataclass
class SchedulerSettings(CommonSettings):
    """Settings of the scheduler (flags or TANDEM_* variables)."""

    mode: str = field(default="disaggregated", metadata={"help": "disaggregated (prefill and decode pools) or colocated"})
    worker_timeout_s: float = field(default=3.0, metadata={"help": "a worker silent this long is dropped"})
    dispatch_timeout_s: float = field(default=5.0, metadata={"help": "how long a worker may take to accept an assignment"})
    alive_file: str = field(default="", metadata={"help": "touched every second, for container health checks; empty = none"})
    scheduler_id: str = field(default="", metadata={"help": "unique id; empty = random"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not (self.worker_timeout_s > 0 and self.dispatch_timeout_s > 0):  # NaN too
            raise ValueError("timeouts must be positive")
