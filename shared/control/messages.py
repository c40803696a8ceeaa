"""Every control-plane message: the typed dataclasses the services exchange over NATS.

Messages carry descriptors and token ids, never tensors: KV bytes travel over UCX. They become bytes
and back only in shared.control.wire (msgpack, every field's type and range checked)."""

from dataclasses import dataclass, field

from shared.control.attempts import AboutAnAttempt, AboutATask
from shared.control.failure import Failure
from shared.control.finish import FinishReason
from shared.control.holdings import GatewayHoldings
from shared.control.worker_roles import Mode, Role
from shared.values.kv_layout import KVLayout
from shared.values.sampling import PromptLogprobs, SamplingParams, TokenLogprob


class _Outcome:
    failure: Failure | None

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass
class GenerateTask(AboutAnAttempt):
    """One request as it travels gateway -> scheduler -> decode worker."""

    attempt_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: str  # where the TokenChunks go
    arrival_time: float  # unix time the gateway accepted it
    deadline: float = 0.0  # unix time after which nobody should work on it; 0 = none
    priority: int = 0  # higher first; first come, first served among equals
    resume_tokens: int = 0  # moved: the prompt's last resume_tokens are output the client has
    avoid_workers: list[str] = field(default_factory=list)  # failed this request before: not again
    moves: int = 0  # times it was placed again (a worker failed or was full): it waits first
    client: str = ""  # who sent it: schedulers take equal priorities from each client in turn


@dataclass
class SubmitReply(_Outcome):
    """The scheduler's answer to a GenerateTask: the workers it was placed on, or why not. A
    failure with Retry.ELSEWHERE is not the request's: blaming a worker (it never confirmed),
    place it again without it; blaming none, submit it to another scheduler (this one stops)."""

    failure: Failure | None = None  # None: placed
    prefill_worker: str = ""  # empty: prefilled on the decode worker
    decode_worker: str = ""
    retry_after_ms: int = 0  # with RESOURCE_EXHAUSTED: when trying again may succeed


@dataclass
class DecodeAssignment(AboutATask):
    """Scheduler -> decode worker. An empty prefill_worker means prefill locally."""

    task: GenerateTask
    prefill_worker: str = ""
    prefill_tp: int = 1  # the prefill worker's tensor-parallel degree (the KV's routes)


@dataclass
class TaskAck(_Outcome):
    """A worker's answer to a task it was handed (or to a Ping): taken, or why not."""

    failure: Failure | None = None  # None: taken


@dataclass
class KVDestination:
    """Where a prompt's KV goes: the KV of tokens [skip_tokens, prompt length) into `block_ids`,
    reserved in the decode worker's pool (it caches the prefix before skip_tokens), in segments
    of `segment_tokens` sent as the prefill computes them, cut into pieces as `connector` does;
    see shared.kvtransfer.plan and shared.kvtransfer.connector."""

    ucx_address: bytes  # the decode worker's UCX worker address
    base_tag: int  # piece i of the transfer travels with UCX tag base_tag + i
    block_ids: list[int]
    skip_tokens: int = 0
    segment_tokens: int = 1024
    lease_s: float = 30.0  # a transfer that makes no progress this long is aborted by either side
    connector: str = "push"  # how the KV moves (shared.kvtransfer.connector.CONNECTORS)
    prefill_tp: int = 1  # the sending worker's tensor-parallel degree, as the scheduler said
    decode_tp: int = 1  # this (the receiving) worker's


@dataclass
class PrefillTask(AboutATask):
    """Decode worker -> prefill worker: compute `task`'s prompt and send its KV to me."""

    task: GenerateTask  # the request it serves, as the decode worker holds it
    layout: KVLayout
    destination: KVDestination
    decode_worker: str


@dataclass
class PrefillResult(_Outcome, AboutAnAttempt):
    """Prefill worker -> decode worker: every piece of the KV is on the wire (or, with a failure,
    the transfer is aborted and the decode worker frees the blocks it reserved)."""

    attempt_id: str
    base_tag: int
    failure: Failure | None = None  # the abort's; movable when the prefill worker is at fault
    first_tokens: list[int] = field(default_factory=list)  # one per choice (sampling.n)
    first_logprobs: list[TokenLogprob] = field(default_factory=list)  # when logprobs were asked
    prompt_logprobs: PromptLogprobs | None = None  # when sampling.prompt_logprobs was asked
    kv_bytes: int = 0
    pieces_sent: int = 0  # on an abort: pieces handed to UCX before it stopped
    transport: str = ""  # the UCX transports that carry the bytes, e.g. "sysv+posix+cma"
    computed_at: float = 0.0  # unix time the prompt's last chunk was computed
    sent_at: float = 0.0  # unix time the first KV piece went on the wire
    cached_tokens: int = 0  # prompt tokens the prefill worker's prefix cache served
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    prefill_worker: str = ""


@dataclass
class TransferAbort(AboutAnAttempt):
    """Decode worker -> prefill worker: stop this transfer and free its blocks (cancelled, lease
    expired, or the decode worker stops)."""

    attempt_id: str
    base_tag: int
    reason: str = ""


@dataclass
class Timing:
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    kv_exposed_ms: float = 0.0
    prefill_worker: str = ""
    decode_worker: str = ""
    path: str = ""  # "disaggregated" or "local"
    cached_tokens: int = 0  # prompt tokens served from a prefix cache


@dataclass
class TokenChunk(AboutAnAttempt):
    """Worker -> gateway: new tokens of one request; the last one has finish_reason or a failure."""

    attempt_id: str
    index: int  # 0, 1, 2, ... per request, so the gateway can spot a gap
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked for
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when asked for
    finish_reason: FinishReason | None = None  # set on its last chunk, unless it failed
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timing: Timing | None = None
    # the request failed; movable: a worker failed or was full, and the gateway places it again
    failure: Failure | None = None


@dataclass
class TokenBatch:
    """Worker -> gateway: one engine step's chunks for that gateway, in one NATS message."""

    chunks: list[TokenChunk] = field(default_factory=list)


@dataclass
class StreamReplay(AboutAnAttempt):
    """Gateway -> decode worker: send the stream again from chunk `from_index` (some were lost
    while NATS was away). Answered TaskAck(); a failure when the worker no longer has it."""

    attempt_id: str
    from_index: int


@dataclass
class CancelRequest(AboutAnAttempt):  # gateway -> every worker
    attempt_id: str
    reason: str = "cancelled"


@dataclass(kw_only=True)
class WorkerStatus:
    """A worker as ClusterStatus shows it (a page of 128 fits the wire cap with room to spare)."""

    worker_id: str
    role: Role
    host: str
    pid: int
    running: int = 0
    queued: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    requests_served: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_transfers_failed: int = 0
    kv_blocks_leaked: int = 0  # held by no live request or transfer: must stay 0
    # held by receives whose peer died mid-transfer: reclaimed once the peer is known gone
    kv_blocks_quarantined: int = 0
    kv_transport: str = ""  # the UCX transports this worker's KV travels on, e.g. "sysv/cma"
    zone: str = ""  # topology label (rack, zone) from settings; host is the other one
    messages_dropped: int = 0  # control messages received malformed or out of range
    kernels: str = ""  # which kernels its engine runs (KernelReport.line); at most MAX_LABEL
    model: str = ""  # "name · architecture · dtype"; at most MAX_LABEL
    tp: int = 1  # tensor-parallel degree: the ranks (processes) of this worker
    tp_ranks: list[str] = field(default_factory=list)  # each rank's heads and pid


@dataclass(kw_only=True)
class WorkerHeartbeat(WorkerStatus):
    """A worker's state, every half second: its status and what routing needs besides."""

    ucx_address: bytes
    layout: KVLayout
    max_model_len: int
    block_size: int = 16
    stopping: bool = False  # draining: take no new work
    max_num_seqs: int = 0  # running batch capacity
    max_queue: int = 0  # requests held beyond which it refuses new ones; 0 = unknown
    prefill_tokens_queued: int = 0  # prompt tokens accepted here and not computed yet
    prefill_tokens_per_s: float = 0.0  # measured prompt throughput; 0 = not measured yet
    decode_step_ms: float = 0.0  # measured time of a step while sequences decode (their ITL)
    prefix_granularity: int = 0  # tokens per prefix-cache granule (the summary's unit)
    prefix_summary: list[int] = field(default_factory=list)  # granule keys cached here


@dataclass
class Room:
    """A worker a gateway may place requests on without asking its scheduler, and how many. A
    decode (or colocated) worker's room is spent by a request's prompt and max new tokens; a
    prefill worker's (SchedulerHeartbeat.prefill_rooms) by a seat in its queue."""

    worker_id: str
    seats: int  # requests it may start now (a prefill worker: places left in its queue)
    kv_tokens: int  # tokens its free KV blocks hold (a prefill worker: the longest prompt it holds)
    # disaggregated: the prefill workers a request placed here takes its prompt from, the
    # cheapest pair first (by the scheduler's cost model); none: it prefills the prompt itself
    prefill_workers: list[str] = field(default_factory=list)
    tp: int = 1  # its tensor-parallel degree (a prefill worker's: the routes its KV takes)


@dataclass
class SchedulerHeartbeat:
    """A scheduler replica is up (every half second), or leaving: gateways submit to live ones.
    While nothing waits in its queue it names the workers with room (`rooms`, and in
    disaggregated mode the prefill workers they pair with): a gateway may place a request of at
    most `direct_prompt_tokens` prompt tokens on one of them itself."""

    scheduler_id: str
    queued: int = 0  # requests waiting in its queue for room
    stopping: bool = False
    accepting: bool = True  # False: it stood aside, hearing no worker (an old beat lacks it: True)
    rooms: list[Room] = field(default_factory=list)  # each prefills its prompts itself
    # disaggregated: decode workers' rooms, each naming its prefill workers (apart from `rooms`:
    # a gateway that knows nothing of pairs places nothing on them), and those prefill workers'
    paired_rooms: list[Room] = field(default_factory=list)
    prefill_rooms: list[Room] = field(default_factory=list)
    direct_prompt_tokens: int = 0  # 0: every request through the scheduler


@dataclass
class Discover:  # a scheduler asks every worker to announce itself now
    scheduler_id: str


@dataclass
class StatusRequest:
    """Gateway -> scheduler: the cluster's state, a page of workers at a time (sorted by id)."""

    after: str = ""  # the workers whose id sorts after this one
    limit: int = 0  # this many at most (the scheduler caps it); 0: none, readiness only


@dataclass
class Ping:
    """Asks a worker whether it is still there; it answers TaskAck() (ok)."""


@dataclass
class StatusReply:
    mode: Mode
    ready: bool
    workers: list[WorkerStatus] = field(default_factory=list)  # the page asked for
    messages_dropped: int = 0  # by this scheduler
    more: bool = False  # workers after this page: ask again, after the last one


# the types that travel on their own (the others travel inside them)
# fmt: off
_WIRE = (GenerateTask, SubmitReply, DecodeAssignment, TaskAck, PrefillTask, PrefillResult,
         TransferAbort, TokenChunk, TokenBatch, StreamReplay, CancelRequest, WorkerHeartbeat,
         SchedulerHeartbeat, Discover, StatusRequest, StatusReply, Ping, GatewayHoldings)
# fmt: on
MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in _WIRE}
