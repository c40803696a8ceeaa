"""A Sequence: everything one request needs while a worker's engine holds it.

`Sequence.from_task` is the one place a wire message becomes engine state: the engine never sees
the message itself, only the fields read here (WireTask names them).
"""

import time
from dataclasses import dataclass, field
from typing import Protocol

from shared.engine.detokenizer import Detokenizer
from shared.engine.penalties import Penalties
from shared.engine.prompt_scores import PromptScores
from shared.engine.seq_status import SeqStatus, checked
from shared.engine.token_mask import TokenMask
from shared.values.sampling import PromptLogprobs, SamplingParams, TokenLogprob


class WireTask(Protocol):
    """What a sequence is made from (a GenerateTask has these fields)."""

    attempt_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    deadline: float
    priority: int
    resume_tokens: int


@dataclass
class StepOutput:
    token_ids: list[int]
    text: str
    finished: SeqStatus | None = None  # the FINISHED_* status this token ended it with
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when asked


class Sequence:
    def __init__(
        self,
        attempt_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        detokenizer: Detokenizer | None,
        eos_token_ids: set[int],
        max_model_len: int,
        prefill_only: bool = False,
        mask: TokenMask | None = None,
    ):
        self.attempt_id = attempt_id
        self.group_id = attempt_id  # the id it was taken on under (n > 1: the group's)
        self.choice = 0  # which choice of its group it is (n > 1)
        self.sampling = sampling
        self.penalties = Penalties.of(sampling, eos_token_ids)  # None: it asks for none
        self.prompt_token_ids = prompt_token_ids
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.prefill_only = prefill_only  # stop after the first token; keep the KV for transfer
        self.mask = mask  # structured output: the tokens its constraint allows next
        self._status = SeqStatus.WAITING
        self.output_ids: list[int] = []
        self.resume_tokens = 0  # output the client had before this (moved) attempt
        self.arrival_time = 0.0  # unix time the gateway accepted it
        self.deadline = 0.0  # unix time after which nobody should work on it; 0 = none
        self.priority = 0  # higher first
        self.block_table: list[int] = []  # paged KV state, down to last_block_hash: BlockManager
        self.num_cached_tokens = 0  # served from the prefix cache at allocation
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self.num_hashed_blocks = 0
        self.last_block_hash = b""
        self.first_tokens: list[int] = []  # sampled by the remote prefill: one per choice
        self.first_logprobs: list[TokenLogprob] = []  # and their logprobs
        # prompt logprobs, gathered here or sent by the prefill worker: out with the first token
        self.prompt_scores = PromptScores.wanted(len(prompt_token_ids), sampling)
        self.prompt_logprobs: PromptLogprobs | None = None
        self.forked_from: Sequence | None = None  # the choice 0 this choice was forked from
        self.abandoned = False  # nobody wants its output any more: a step of only such stops early
        self.queue_ms = self.prefill_ms = 0.0
        self.kv_transfer_ms = 0.0  # first KV piece sent -> last one landed
        self.kv_exposed_ms = 0.0  # prefill finished -> last KV piece landed
        self.cached_tokens = 0  # prompt tokens a prefix cache served, for Timing
        self.prefill_started = 0.0

    @classmethod
    def from_task(
        cls,
        task: WireTask,
        detokenizer: Detokenizer | None,
        eos_token_ids: set[int],
        max_model_len: int,
        prefill_only: bool = False,
        mask: TokenMask | None = None,
    ) -> "Sequence":
        """`mask`: the state of its constraint (task.sampling.constraint) after the output the
        task resumes from, made by the worker, which has the grammar engine."""
        seq = cls(
            task.attempt_id,
            task.prompt_token_ids,
            task.sampling,
            detokenizer,
            eos_token_ids,
            max_model_len,
            prefill_only,
            mask,
        )
        seq.resume_tokens, seq.priority = task.resume_tokens, task.priority
        seq.arrival_time, seq.deadline = task.arrival_time, task.deadline
        return seq

    @property
    def status(self) -> SeqStatus:
        return self._status

    def move(self, to: SeqStatus) -> None:
        """The one way its status changes (seq_status.MOVES; IllegalMove otherwise)."""
        self._status = checked(self._status, to)

    def rename(self, attempt_id: str, sampling: SamplingParams) -> None:
        """The group's own sequence goes on as its choice 0: that choice's id and sampling."""
        self.attempt_id, self.sampling = attempt_id, sampling

    def fork(self, attempt_id: str, sampling: SamplingParams, choice: int) -> "Sequence":
        """Another choice of this request from the same computed prompt; its blocks come from
        BlockManager.fork."""
        detokenizer = self.detokenizer.fork() if self.detokenizer is not None else None
        child = Sequence(
            attempt_id,
            self.prompt_token_ids,
            sampling,
            detokenizer,
            self.eos_token_ids,
            self.max_model_len,
            mask=self.mask.fork() if self.mask is not None else None,
        )
        child.group_id, child.choice, child.forked_from = self.group_id, choice, self
        child.penalties = self.penalties.copy() if self.penalties is not None else None
        child.num_computed_tokens = self.num_computed_tokens
        for name in (
            "resume_tokens",
            "arrival_time",
            "deadline",
            "priority",
            "queue_ms",
            "prefill_ms",
            "kv_transfer_ms",
            "kv_exposed_ms",
            "cached_tokens",
            "prefill_started",
            "prompt_logprobs",
        ):
            setattr(child, name, getattr(self, name))
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
        return self._status is SeqStatus.WAITING

    @property
    def reuses_prefix(self) -> bool:
        """Whether its prompt may start from cached blocks: not when its prompt logprobs are
        asked for (a cached position has no logits)."""
        return self.prompt_scores is None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def expired(self) -> bool:
        return self.expired_at(time.time())

    def expired_at(self, now: float) -> bool:
        """Past its deadline at `now` (unix time); never without one."""
        return bool(self.deadline) and now > self.deadline

    def append(self, token_id: int, logprob: TokenLogprob | None = None) -> StepOutput:
        """Records a sampled token; finishes the sequence when it is done."""
        self.output_ids.append(token_id)
        if self.mask is not None:
            self.mask.accept(token_id)
        if self.penalties is not None:
            self.penalties.add(token_id)
        text = self.detokenizer.add(token_id) if self.detokenizer else ""
        ended = self._ending(token_id)
        if ended is not None:
            if self.detokenizer is not None:
                text += self.detokenizer.flush()
            self.move(ended)
        out = StepOutput([token_id], text, ended, [logprob] if logprob else [])
        if len(self.output_ids) == 1:
            out.prompt_logprobs = self.prompt_logprobs
        return out

    def _ending(self, token_id: int) -> SeqStatus | None:
        if self.prefill_only:
            return SeqStatus.FINISHED_LENGTH
        if self.mask is not None and self.mask.finished:  # its constrained output is complete
            return SeqStatus.FINISHED_STOPPED
        if (
            self.detokenizer is not None
            and self.detokenizer.stopped
            or token_id in self.eos_token_ids
            and not self.sampling.ignore_eos
        ):
            return SeqStatus.FINISHED_STOPPED
        if (
            len(self.output_ids) >= self.sampling.max_tokens
            or self.num_tokens >= self.max_model_len
        ):
            return SeqStatus.FINISHED_LENGTH
        return None
