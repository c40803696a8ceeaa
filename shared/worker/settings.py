"""WorkerSettings: the settings of every model worker (prefill, decode, colocated), beyond
CommonSettings': the data-plane helper's clocks, how KV transfers move and how long they may
take, the model and engine, the KV cache and batch, the data plane, and the worker's life."""

import os
import re
import uuid
from dataclasses import dataclass, field

from shared.control.worker_roles import Role
from shared.dataplane.helper_link import HelperTiming
from shared.kvtransfer.connector import CONNECTORS
from shared.kvtransfer.fetch import FetchTimes
from shared.settings import CommonSettings
from shared.worker.placement import parse_cpus

CHOICES = {  # settings with a fixed set of values
    "weights": ("native", "int8"),
    "kernels": ("auto", "off"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "kv_plane": ("helper", "inprocess"),
    "engine": ("model", "mock"),
    "ucx_progress_mode": ("blocking", "thread", "polling"),
}
_WORKER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


# settings that must be above 0
POSITIVE = (
    "kv_cache_mb",
    "block_size",
    "max_queue",
    "steps_ahead",
    "max_num_seqs",
    "max_batch_tokens",
    "prefill_chunk_tokens",
    "max_held_chunks",
    "mock_workers",
    "tp",
    "tp_collective_timeout_s",
    "tp_start_timeout_s",
)


@dataclass
class WorkerSettings(CommonSettings):
    # how long a worker gives its KV data-plane helper process (shared.dataplane.helper_link)
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
    # how a worker moves KV (shared.kvtransfer)
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
    # the model, its engine, and the rest of the worker
    model: str = field(
        default="",
        metadata={"help": "HF model directory or .gguf file; empty = SmolLM2-135M-Instruct"},
    )
    engine: str = field(
        default="model",
        metadata={
            "help": "model (run the model) or mock (no compute: wait as the timing model says, deterministic tokens; for control-plane measurements)"
        },
    )
    mock_timing: str = field(
        default="",
        metadata={
            "help": "the mock engine's timing model (JSON from bench/fit_timing.py); empty = the one fitted on SmolLM2-135M here"
        },
    )
    mock_speedup: float = field(
        default=1.0,
        metadata={"help": "the mock engine waits step time / this; 0 = no wait at all"},
    )
    mock_kv_bytes_per_token: int = field(
        default=-1,
        metadata={
            "help": "KV bytes per token the mock engine holds and moves (0: 2, the least; up to the model's); -1 = the model's"
        },
    )
    mock_workers: int = field(
        default=1,
        metadata={
            "help": "with --engine mock: this many workers in this process, sharing its NATS connection, data plane and tokenizer (control-plane scale tests)"
        },
    )
    model_cache: str = field(
        default="~/.cache/tandem/models",
        metadata={"help": "where converted GGUF models are cached"},
    )
    row_timing_file: str = field(
        default="",
        metadata={
            "help": "where the fastest row count, timed at start, is kept for the next start; "
            "empty = row-timing.json in model_cache (set it where model_cache is read-only)"
        },
    )
    device: str = field(
        default="auto", metadata={"help": "auto (cuda when present), cpu, cuda or cuda:N"}
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "auto (the checkpoint's), float32, bfloat16 or float16 (CPUs with FP16)"},
    )
    weights: str = field(
        default="native",
        metadata={
            "help": "native (the dtype setting) or int8 (dynamically quantized linear layers, CPU; faster, not bit-exact)"
        },
    )
    kernels: str = field(
        default="auto",
        metadata={
            "help": "auto (Tandem's C++ CPU kernels where they build and apply) or off (plain torch ops)"
        },
    )
    cpus: str = field(
        default="",
        metadata={
            "help": "the cores to run on, e.g. 0-3,6 (tandem up sets it per worker); empty = every core"
        },
    )
    torch_threads: int = field(
        default=0,
        metadata={
            "help": "torch intra-op threads (with --tp, of all the worker's ranks together); 0 = one per core of --cpus, else torch's default"
        },
    )
    tp: int = field(
        default=1,
        metadata={
            "help": "tensor-parallel degree: this worker's ranks (processes), each holding 1/tp of every layer's heads and KV; rank 0 is this process"
        },
    )
    tp_collective_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "the longest one collective of a tensor-parallel group may wait for a rank: past it the group fails instead of hanging"
        },
    )
    tp_start_timeout_s: float = field(
        default=600.0,
        metadata={"help": "the longest the ranks of a tensor-parallel group may take to load"},
    )
    kv_cache_mb: int = field(
        default=1024,
        metadata={"help": "KV cache budget of this worker in MiB (of each rank's, with --tp)"},
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    max_num_seqs: int = field(
        default=64, metadata={"help": "sequences in the running batch at most"}
    )
    max_batch_tokens: int = field(
        default=512, metadata={"help": "rows per forward step: decode tokens plus prompt chunks"}
    )
    prefill_chunk_tokens: int = field(
        default=128,
        metadata={
            "help": "prompts are computed in chunks of this many tokens (a multiple of block_size)"
        },
    )
    batch_invariant: bool = field(
        default=True,
        metadata={
            "help": "same bits alone or in a batch (pads tiny GEMMs; off = faster batch-1 decode)"
        },
    )
    cuda_graphs: bool = field(
        default=True,
        metadata={
            "help": "on a GPU, decode steps replayed from CUDA graphs (one per batch size up to 128, captured at start-up; a decode worker's or a colocated one's); off: every kernel launched from Python"
        },
    )
    max_model_len: int = field(
        default=0, metadata={"help": "longest prompt + output; 0 = the model's own limit"}
    )
    max_queue: int = field(
        default=256,
        metadata={"help": "requests held (running and waiting) beyond which new ones are refused"},
    )
    steps_ahead: int = field(
        default=4,
        metadata={
            "help": "a decode worker's engine steps on while this many steps' tokens wait to be published; the loop then sends a stream's tokens of those steps as one chunk (1: one step ahead, each step's tokens sent alone)"
        },
    )
    worker_id: str = field(
        default="", metadata={"help": "unique id; empty = role plus a random suffix"}
    )
    host_label: str = field(
        default="", metadata={"help": "host name announced to the scheduler; empty = this host's"}
    )
    ucx_net_devices: str = field(
        default="lo",
        metadata={
            "help": "UCX_NET_DEVICES for the KV data plane (lo = loopback only; 'all' in containers)"
        },
    )
    ucx_tls: str = field(
        default="", metadata={"help": "UCX_TLS for the KV data plane; empty = UCX's choice"}
    )
    ucx_error_handling: bool = field(
        default=False,
        metadata={
            "help": "UCX peer-failure mode on KV endpoints; UCX then uses tcp only, never shared memory (dead peers are found by leases either way)"
        },
    )
    ucx_rndv_scheme: str = field(
        default="",
        metadata={
            "help": "UCX_RNDV_SCHEME for large KV pieces; empty = UCX's choice (on one host the receiver reads the sender's memory). put_zcopy: the sender writes, so a prefill worker SIGKILLed mid-transfer cannot crash a decode worker, but a decode worker's death can crash the prefill worker (docs/reliability.md: A dead peer inside UCX)"
        },
    )
    kv_plane: str = field(
        default="helper",
        metadata={
            "help": "where the KV data plane's UCX runs: helper (a process of its own over the shared KV pool, so a crash inside UCX costs only the transfers in flight; host-memory pools) or inprocess"
        },
    )
    ucx_progress_mode: str = field(
        default="blocking",
        metadata={
            "help": "how UCX makes progress: blocking (woken from the event loop), thread (ucxx's own thread) or polling (busy)"
        },
    )
    zone: str = field(
        default="",
        metadata={
            "help": "topology label (rack or zone) announced with the host, for pairing close workers"
        },
    )
    kv_segment_tokens: int = field(
        default=0,
        metadata={
            "help": "a prompt's KV is sent in segments of this many tokens, each as soon as it is computed (a multiple of block_size); 0: 1024 for a KV pool in host memory, 16384 for one on a GPU, where each message's fixed cost outweighs its bytes"
        },
    )
    worker_timeout_s: float = field(
        default=3.0, metadata={"help": "a peer worker silent this long is taken for dead"}
    )
    drain_timeout_s: float = field(
        default=30.0, metadata={"help": "on SIGTERM, how long running requests may take to finish"}
    )
    alive_file: str = field(
        default="",
        metadata={"help": "touched on every heartbeat, for container health checks; empty = none"},
    )
    prefix_summary_limit: int = field(
        default=1024,
        metadata={
            "help": "prefix-cache granules announced in each heartbeat at most (newest first), for cache-aware routing"
        },
    )
    heartbeat_interval_s: float = field(
        default=0.5, metadata={"help": "seconds between load reports"}
    )
    stream_retain_s: float = field(
        default=60.0,
        metadata={
            "help": "a decode worker keeps an ended stream's token chunks this long, for a gateway that lost some (NATS outage)"
        },
    )
    max_held_chunks: int = field(
        default=4096,
        metadata={
            "help": "token chunks of one stream a decode worker holds unsent (NATS unreachable) before it fails the request"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_kv_transfers()
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                allowed = ", ".join(choices[:-1]) + " or " + choices[-1]
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
        if self.cpus:
            parse_cpus(self.cpus)  # ValueError naming the list
        self._check_mock()
        if self.prefix_summary_limit < 0:
            raise ValueError("prefix_summary_limit must not be negative")
        for name in POSITIVE:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.kv_segment_tokens < 0 or self.kv_segment_tokens % self.block_size:
            raise ValueError("kv_segment_tokens must be 0 (automatic) or a multiple of block_size")
        if self.prefill_chunk_tokens % self.block_size:
            raise ValueError("prefill_chunk_tokens must be a multiple of block_size")
        if self.max_batch_tokens < self.prefill_chunk_tokens:
            raise ValueError("max_batch_tokens must be at least prefill_chunk_tokens")
        for name in (
            "heartbeat_interval_s",
            "drain_timeout_s",
            "worker_timeout_s",
            "stream_retain_s",
        ):
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"{name} must be positive")
        if self.worker_id and not _WORKER_ID.fullmatch(self.worker_id):
            raise ValueError(
                "worker_id must be 1-64 of A-Z a-z 0-9 _ - (it becomes a NATS subject token)"
            )

    def _check_kv_transfers(self) -> None:
        """The data-plane helper's clocks, and the KV transfers' connector and clocks."""
        self.require_seconds("kv_helper_start_timeout_s", "kv_helper_hang_s", "kv_helper_ping_s")
        if self.kv_helper_ping_s >= self.kv_helper_hang_s:
            raise ValueError("kv_helper_ping_s must be shorter than kv_helper_hang_s")
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {sorted(CONNECTORS)}")
        self.require_seconds(
            "kv_lease_s", "prefill_timeout_s", "kv_ask_timeout_s", "kv_poll_s", "kv_reclaim_poll_s"
        )

    def _check_mock(self) -> None:
        if not self.mock_speedup >= 0 or self.mock_kv_bytes_per_token < -1:
            raise ValueError("mock_speedup and mock_kv_bytes_per_token must not be negative")
        if self.mock_workers > 1 and self.engine != "mock":
            raise ValueError("mock_workers needs engine mock (a model worker is one per process)")
        if self.tp > 1 and self.engine == "mock":
            raise ValueError("tp needs a model: a mock engine has no heads to split")

    def resolved_worker_id(self, role: Role) -> str:
        return self.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"

    def resolved_host(self) -> str:
        return self.host_label or os.uname().nodename

    def helper_timing(self) -> HelperTiming:
        return HelperTiming(
            self.kv_helper_start_timeout_s, self.kv_helper_hang_s, self.kv_helper_ping_s
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
