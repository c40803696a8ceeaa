"""How a worker moves KV (shared.kvtransfer): the settings of its transfers, beyond the
helper's (WorkerSettings builds on these)."""

from dataclasses import dataclass, field

from shared.kvtransfer.connector import CONNECTORS
from shared.kvtransfer.fetch import FetchTimes
from shared.worker.helper_settings import HelperSettings


@dataclass
class TransferSettings(HelperSettings):
    kv_connector: str = field(
        default="push",
        metadata={
            "help": "how a decode worker has its KV moved: push (a message per run of "
            "consecutive blocks, landing in place) or staged (a message per segment, gathered on "
            "the prefill side and scattered on landing: for fragmented pools); prefill workers "
            "serve both"
        },
    )
    kv_lease_s: float = field(
        default=30.0,
        metadata={
            "help": "a KV transfer that makes no progress this long is aborted, and its blocks "
            "freed, on both sides"
        },
    )
    prefill_timeout_s: float = field(
        default=300.0, metadata={"help": "how long a decode worker waits for a remote prefill"}
    )
    kv_ask_timeout_s: float = field(
        default=5.0,
        metadata={"help": "how long a decode worker waits for a prefill worker to accept a task"},
    )
    kv_poll_s: float = field(
        default=0.25,
        metadata={
            "help": "how often a worker looks at a KV transfer's clocks (a decode worker also at "
            "its prefill worker's liveness; a prefill worker, draining, at deadlines and aborts)"
        },
    )
    kv_reclaim_poll_s: float = field(
        default=1.0,
        metadata={
            "help": "how often a decode worker looks whether the peer of quarantined KV blocks "
            "is gone"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {sorted(CONNECTORS)}")
        self.require_seconds(
            "kv_lease_s", "prefill_timeout_s", "kv_ask_timeout_s", "kv_poll_s", "kv_reclaim_poll_s"
        )

    def fetch_times(self) -> FetchTimes:
        """The decode side's clocks of a transfer."""
        return FetchTimes(
            self.kv_lease_s,
            self.prefill_timeout_s,
            self.kv_ask_timeout_s,
            self.kv_poll_s,
            self.kv_reclaim_poll_s,
        )
