"""A Sequence: everything one request needs while a worker holds it."""

import enum
import time
from dataclasses import dataclass

from shared.engine.detokenizer import Detokenizer
from shared.messages import GenerateTask


class SeqStatus(enum.Enum):
    WAITING_KV = "waiting_kv"            # remote prefill running; KV not here yet
    WAITING_PREFILL = "waiting_prefill"  # to be prefilled by this worker
    KV_READY = "kv_ready"                # remote KV arrived; its first token not yet emitted
    RUNNING = "running"                  # decoding
    FINISHED = "finished"


@dataclass
class StepOutput:
    token_ids: list[int]
    text: str
    finish_reason: str = ""


class Sequence:
    def __init__(self, task: GenerateTask, detokenizer: Detokenizer, eos_token_ids: set[int],
                 max_model_len: int):
        self.task = task
        self.request_id = task.request_id
        self.sampling = task.sampling
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.status = SeqStatus.WAITING_PREFILL
        self.output_ids: list[int] = []
        self.cache = None
        self.kv_buffer = None                       # the received KV, until unpacked
        self.first_token = -1                       # sampled by the remote prefill
        self.cancel_reason = ""
        self.finish_reason = ""
        self.error: tuple[str, str] | None = None   # (gRPC code name, message)
        self.chunk_index = 0
        self.queue_ms = 0.0
        self.prefill_ms = 0.0
        self.kv_transfer_ms = 0.0
        self.prefill_worker = ""
        self.admitted_at = time.time()

    @property
    def prompt_len(self) -> int:
        return len(self.task.prompt_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def expired(self) -> bool:
        return bool(self.task.deadline) and time.time() > self.task.deadline

    def append(self, token_id: int) -> StepOutput:
        """Records a sampled token; decides whether the sequence is done."""
        self.output_ids.append(token_id)
        text = self.detokenizer.add(token_id)
        reason = ""
        if self.detokenizer.stopped:
            reason = "stop"
        elif token_id in self.eos_token_ids and not self.sampling.ignore_eos:
            reason = "stop"
        elif (len(self.output_ids) >= self.sampling.max_tokens
              or self.prompt_len + len(self.output_ids) >= self.max_model_len):
            reason = "length"
        if reason:
            text += self.detokenizer.flush()
            self.finish_reason = reason
            self.status = SeqStatus.FINISHED
        return StepOutput([token_id], text, reason)
