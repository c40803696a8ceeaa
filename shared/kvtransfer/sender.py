"""KVSender: one prompt's KV, sent by the prefill worker a segment at a time as it is computed.

Each segment is packed once out of the prefill pool (the one copy on this side, made in the
engine thread between steps) and its pieces go out concurrently, each straight into the decode
pool range the plan names. The prefill blocks can be freed as soon as the last segment is
packed; the packed copies live until UCX has sent them.
"""

import asyncio
import logging

import torch

from shared.engine.kv_cache import KVPool
from shared.kvtransfer.plan import Segment, TransferPlan
from shared.transport.kv import DataPlane, KVTransferError

log = logging.getLogger(__name__)


class KVSender:
    def __init__(self, plane: DataPlane, pool: KVPool, plan: TransferPlan, timeout_s: float):
        self.plane = plane
        self.pool = pool
        self.plan = plan
        self.timeout_s = timeout_s
        self.next_segment = 0          # the first segment not packed yet
        self.pieces_sent = 0           # pieces handed to UCX (the tags the decode side must drain on abort)
        self.bytes_sent = 0
        self.aborted = False
        self.sends: list[asyncio.Task] = []

    @property
    def all_packed(self) -> bool:
        return self.next_segment == len(self.plan.segments)

    def ready(self, computed_tokens: int) -> list[Segment]:
        """Segments whose every token is computed and that are not packed yet."""
        out = []
        for seg in self.plan.segments[self.next_segment:]:
            if seg.end > computed_tokens:
                break
            out.append(seg)
        return out

    def pack(self, segment: Segment, block_table: list[int]) -> torch.Tensor:
        """Engine thread: the segment's KV as one [layers, 2, tokens, heads, dim] buffer."""
        staging = self.pool.export(self.pool.slots(block_table, segment.start, segment.end))
        if staging.is_cuda:  # UCX reads it on its own streams: the copy must have landed
            torch.cuda.current_stream().synchronize()
        self.next_segment = segment.index + 1
        return staging

    def send(self, segment: Segment, staging: torch.Tensor) -> asyncio.Task:
        """Puts every piece of a packed segment on the wire; the task ends when all have left."""
        pieces = [(self.plan.tag(p), staging[p.layer, p.kv, p.start - segment.start:p.end - segment.start])
                  for p in segment.pieces]
        self.pieces_sent = segment.pieces[-1].index + 1
        task = asyncio.create_task(self._send_all(pieces))
        self.sends.append(task)
        return task

    async def _send_all(self, pieces: list[tuple[int, torch.Tensor]]) -> None:
        address = self.plan.destination.ucx_address
        results = await asyncio.gather(*(self.plane.send(address, tag, buf, self.timeout_s) for tag, buf in pieces),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise KVTransferError(f"{len(errors)} of {len(pieces)} KV pieces not sent: {errors[0]!r}")
        self.bytes_sent += sum(b.numel() * b.element_size() for _, b in pieces)

    async def finish(self) -> None:
        """Waits for every segment put on the wire; raises KVTransferError if any piece failed."""
        results = await asyncio.gather(*self.sends, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0] if isinstance(errors[0], KVTransferError) else KVTransferError(repr(errors[0]))
