import math
import uuid
from dataclasses import dataclass, field

from services.scheduler.presence import BEAT_S
from services.scheduler.router import Policy
from shared.control.worker_roles import Mode
from shared.settings import CommonSettings

PREFILL_FALLBACKS = ("local", "wait", "fail")


@dataclass
class SchedulerSettings(CommonSettings):
    """Settings of the scheduler (flags or TANDEM_* variables)."""

    mode: Mode = field(
        default=Policy.mode,
        metadata={
            "help": "auto (short prompts, or all when the prefill pool is busy, prefilled on the decode worker), disaggregated (always a prefill worker) or colocated (colocated workers only)"
        },
    )
    local_prefill_tokens: int = field(
        default=Policy.local_prefill_tokens,
        metadata={
            "help": "auto mode: prompts with at most this many tokens to compute after the decode worker's prefix cache are prefilled there"
        },
    )
    prefill_busy_s: float = field(
        default=Policy.prefill_busy_s,
        metadata={
            "help": "auto mode: when the best prefill worker's expected wait is over this, prefill on the decode worker if that is sooner"
        },
    )
    max_prefill_wait_s: float = field(
        default=Policy.max_prefill_wait_s,
        metadata={
            "help": "a request whose prefill worker has more than this much prompt work queued ahead waits in the scheduler's queue for room"
        },
    )
    decode_slack: float = field(
        default=Policy.decode_slack,
        metadata={
            "help": "decode workers whose fill differs by at most this are equals; the cost model (prefix cache, topology) picks among them"
        },
    )
    max_itl_ms: float = field(
        default=Policy.max_itl_ms,
        metadata={
            "help": "a decode worker whose measured step time (the gap between its sequences' tokens) is over this takes no new sequences until it falls, so admission bounds latency, not only memory; 0 = off"
        },
    )
    prefill_fallback: str = field(
        default=Policy.prefill_fallback,
        metadata={
            "help": "disaggregated mode, when no prefill worker is live (the last one lost mid-prompt, say): local (prefill on the decode worker), wait (in the scheduler's queue, up to queue_timeout_s and the request's deadline) or fail (UNAVAILABLE)"
        },
    )
    direct_prompt_tokens: int = field(
        default=256,
        metadata={
            "help": "while nothing waits in this scheduler's queue, its heartbeat names the workers with room, and a gateway places a request of at most this many prompt tokens on one itself (one hop and this scheduler's turn fewer); auto mode: at most local_prefill_tokens; disaggregated: with a prefill worker the room names; none with max_itl_ms; 0 = every request through the scheduler"
        },
    )
    max_pending: int = field(
        default=256,
        metadata={
            "help": "requests waiting for room at most; beyond, new ones get RESOURCE_EXHAUSTED at once"
        },
    )
    queue_timeout_s: float = field(
        default=15.0,
        metadata={
            "help": "a request that found no room this long gets RESOURCE_EXHAUSTED with a retry-after hint (keep it under the gateways' submit_timeout_s, 20 s: past that they submit it again)"
        },
    )
    heartbeat_interval_s: float = field(
        default=BEAT_S,
        metadata={"help": "seconds between this scheduler's heartbeats to gateways and peers"},
    )
    worker_timeout_s: float = field(
        default=3.0, metadata={"help": "a worker silent this long is dropped"}
    )
    dispatch_timeout_s: float = field(
        default=5.0, metadata={"help": "how long a worker may take to accept an assignment"}
    )
    alive_file: str = field(
        default="",
        metadata={"help": "touched every second, for container health checks; empty = none"},
    )
    scheduler_id: str = field(default="", metadata={"help": "unique id; empty = random"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in tuple(Mode):
            raise ValueError(f"mode must be one of {', '.join(Mode)}, got {self.mode!r}")
        self.mode = Mode(self.mode)
        if self.prefill_fallback not in PREFILL_FALLBACKS:
            raise ValueError(
                f"prefill_fallback must be one of {PREFILL_FALLBACKS}, got {self.prefill_fallback!r}"
            )
        for name in (
            "heartbeat_interval_s",
            "worker_timeout_s",
            "dispatch_timeout_s",
            "queue_timeout_s",
            "prefill_busy_s",
            "max_prefill_wait_s",
        ):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):  # NaN too
                raise ValueError(f"{name} must be a positive number")
        if not (self.max_itl_ms >= 0 and math.isfinite(self.max_itl_ms)):
            raise ValueError("max_itl_ms must be >= 0 (0 = off)")
        if self.direct_prompt_tokens < 0:
            raise ValueError("direct_prompt_tokens must be >= 0 (0 = off)")
        if self.local_prefill_tokens < 0 or self.max_pending < 1 or not 0 <= self.decode_slack <= 1:
            raise ValueError(
                "local_prefill_tokens must be >= 0, max_pending >= 1, decode_slack in [0, 1]"
            )
        if not self.scheduler_id:
            self.scheduler_id = f"scheduler-{uuid.uuid4().hex[:8]}"

    def policy(self) -> Policy:
        return Policy(
            mode=self.mode,
            local_prefill_tokens=self.local_prefill_tokens,
            prefill_busy_s=self.prefill_busy_s,
            max_prefill_wait_s=self.max_prefill_wait_s,
            decode_slack=self.decode_slack,
            max_itl_ms=self.max_itl_ms,
            prefill_fallback=self.prefill_fallback,
        )
