"""A Sequence: everything one request needs while a worker holds it."""

import enum
import time
from dataclasses import dataclass, field

from shared.control.messages import GenerateTask, TokenLogprob
from shared.engine.detokenizer import Detokenizer


class SeqStatus(enum.Enum):
    WAITING_KV = "waiting_kv"  # remote prefill running; KV not here yet
    WAITING = "waiting"  # prompt (or part of it) still to compute here
    KV_READY = "kv_ready"  # remote KV arrived; to be written into the pool
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass
class StepOutput:
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked


class Sequence:
    def __init__(
        self,
        task: GenerateTask,
        detokenizer: Detokenizer | None,
        eos_token_ids: set[int],
        max_model_len: int,
        prefill_only: bool = False,
    ):
        self.task = task
        self.attempt_id = task.attempt_id
        self.sampling = task.sampling
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.prefill_only = prefill_only  # stop after the first token; keep the KV for transfer
        self.status = SeqStatus.WAITING
        self.prompt_token_ids = task.prompt_token_ids
        self.output_ids: list[int] = []
        self.resume_tokens = task.resume_tokens  # output the client had before this (moved) attempt
        # Paged KV state (see BlockManager and KVPool).
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # served from the prefix cache at allocation
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self.num_hashed_blocks = 0
        self.last_block_hash = b""
        # sampled by the remote prefill: the first token of each choice (and its logprob)
        self.first_tokens: list[int] = []
        self.first_logprobs: list[TokenLogprob] = []
        self.forked_from: Sequence | None = None  # the choice 0 this choice was forked from
        self.group_id = task.attempt_id  # the id it was taken on under (n > 1: the group's)
        self.finish_reason = ""
        self.abandoned = False  # nobody wants its output any more: a step of only such stops early
        self.queue_ms = 0.0
        self.prefill_ms = 0.0
        self.kv_transfer_ms = 0.0  # first KV piece sent -> last one landed
        self.kv_exposed_ms = 0.0  # prefill finished -> last KV piece landed
        self.cached_tokens = 0  # prompt tokens a prefix cache served, for Timing
        self.prefill_started = 0.0

    def become(self, task: GenerateTask) -> None:
        """The group's own sequence goes on as its choice 0: that choice's id and sampling."""
        self.task, self.attempt_id, self.sampling = task, task.attempt_id, task.sampling

    def fork(self, task: GenerateTask) -> "Sequence":
        """Another choice of this request (`task`: its id and sampling) from the same computed
        prompt; its blocks come from BlockManager.fork."""
        detokenizer = self.detokenizer.fork() if self.detokenizer is not None else None
        child = Sequence(task, detokenizer, self.eos_token_ids, self.max_model_len)
        child.forked_from = self
        child.num_computed_tokens = self.num_computed_tokens
        for name in ("queue_ms", "prefill_ms", "kv_transfer_ms", "kv_exposed_ms", "cached_tokens"):
            setattr(child, name, getattr(self, name))
        child.prefill_started = self.prefill_started
        return child

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_ids)

    @property
    def position(self) -> int:
        """The output position of the next token: what seeded sampling is keyed by."""
        return self.resume_tokens + len(self.output_ids)

    @property
    def computing_prompt(self) -> bool:
        """Its rows in a step are prompt rows (a preempted sequence's again too), not a decode."""
        return self.status is SeqStatus.WAITING

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def expired(self) -> bool:
        return bool(self.task.deadline) and time.time() > self.task.deadline

    def append(self, token_id: int, logprob: TokenLogprob | None = None) -> StepOutput:
        """Records a sampled token; decides whether the sequence is done."""
        self.output_ids.append(token_id)
        text = self.detokenizer.add(token_id) if self.detokenizer else ""
        reason = ""
        if self.prefill_only:
            reason = "length"
        elif (
            self.detokenizer is not None
            and self.detokenizer.stopped
            or token_id in self.eos_token_ids
            and not self.sampling.ignore_eos
        ):
            reason = "stop"
        elif (
            len(self.output_ids) >= self.sampling.max_tokens
            or self.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason:
            if self.detokenizer is not None:
                text += self.detokenizer.flush()
            self.finish_reason = reason
            self.status = SeqStatus.FINISHED
        return StepOutput([token_id], text, reason, [logprob] if logprob else [])
