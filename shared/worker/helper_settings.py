"""How long a worker gives its KV data-plane helper process (shared.dataplane.helper_link): the
settings every model worker has beyond CommonSettings' (WorkerSettings builds on these)."""

from dataclasses import dataclass, field

from shared.dataplane.helper_link import HelperTiming
from shared.settings import CommonSettings


@dataclass
class HelperSettings(CommonSettings):
    kv_helper_start_timeout_s: float = field(
        default=HelperTiming.start_s,
        metadata={
            "help": "how long the KV data-plane helper may take to start (import UCX, map the "
            "pool) before the worker gives up"
        },
    )
    kv_helper_hang_s: float = field(
        default=HelperTiming.hang_s,
        metadata={
            "help": "a KV data-plane helper that answers no ping this long is replaced (its "
            "transfers in flight fail); it is also how long an operation's answer may come late"
        },
    )
    kv_helper_ping_s: float = field(
        default=HelperTiming.ping_s,
        metadata={"help": "seconds between two pings of the KV data-plane helper"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_seconds("kv_helper_start_timeout_s", "kv_helper_hang_s", "kv_helper_ping_s")
        if self.kv_helper_ping_s >= self.kv_helper_hang_s:
            raise ValueError("kv_helper_ping_s must be shorter than kv_helper_hang_s")

    def helper_timing(self) -> HelperTiming:
        return HelperTiming(
            self.kv_helper_start_timeout_s, self.kv_helper_hang_s, self.kv_helper_ping_s
        )
