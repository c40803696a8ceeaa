"""KVSender: one prompt's KV, sent by the prefill worker a segment at a time as it is computed.

A piece whose tokens sit in consecutive slots of this pool (the block allocator hands out
consecutive runs when it can) is sent straight from the pool: no copy on either side. Any other
piece is gathered once into a buffer of its own (the one copy on this side), in the engine
thread between steps. The pieces of a segment go out concurrently, each straight into the
decode pool range the plan names. The prompt's blocks must stay held until `finish` returns.
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
        self.next_segment = 0          # the first segment not staged yet
        self.pieces_sent = 0           # pieces handed to UCX (the tags the decode side must drain on abort)
        self.bytes_sent = 0
        self.aborted = False
        self.sends: list[asyncio.Task] = []

    @property
    def all_staged(self) -> bool:
        return self.next_segment == len(self.plan.segments)

    def ready(self, computed_tokens: int) -> list[Segment]:
        """Segments whose every token is computed and that are not staged yet."""
        out = []
        for seg in self.plan.segments[self.next_segment:]:
            if seg.end > computed_tokens:
                break
            out.append(seg)
        return out

    def stage(self, segment: Segment, block_table: list[int]) -> list[tuple[int, torch.Tensor]]:
        """Engine thread: (tag, source) of every piece of the segment; views of the pool where
        the piece is one run of slots here, gathered copies elsewhere."""
        sources: dict[tuple[int, int], int | torch.Tensor] = {}   # token range -> first slot, or slots
        out = []
        copied = False
        for p in segment.pieces:
            where = sources.get((p.start, p.end))
            if where is None:
                where = sources[(p.start, p.end)] = self._first_slot(block_table, p.start, p.end)
            if isinstance(where, int):
                out.append((self.plan.tag(p), self.pool.span(p.layer, p.kv, where, p.tokens)))
            else:
                out.append((self.plan.tag(p), self.pool.kv[p.layer, p.kv].index_select(0, where)))
                copied = True
        if copied and self.pool.kv.is_cuda:  # UCX reads it on its own streams: the copy must have landed
            torch.cuda.current_stream().synchronize()
        self.next_segment = segment.index + 1
        return out

    def _first_slot(self, block_table: list[int], start: int, end: int) -> int | torch.Tensor:
        """The first slot of positions [start, end) when they are consecutive slots, else all their slots."""
        bs = self.pool.block_size
        first, last = start // bs, (end - 1) // bs
        if all(block_table[b] == block_table[first] + b - first for b in range(first, last + 1)):
            return block_table[first] * bs + start % bs
        return self.pool.slots(block_table, start, end)

    def send(self, segment: Segment, sources: list[tuple[int, torch.Tensor]]) -> asyncio.Task:
        """Puts every piece of a staged segment on the wire; the task ends when all have left."""
        self.pieces_sent = segment.pieces[-1].index + 1
        task = asyncio.create_task(self._send_all(sources))
        self.sends.append(task)
        return task

    async def _send_all(self, pieces: list[tuple[int, torch.Tensor]]) -> None:
        await self.plane.send_many(self.plan.destination.ucx_address, pieces, self.timeout_s)
        self.bytes_sent += sum(b.numel() * b.element_size() for _, b in pieces)

    async def finish(self) -> None:
        """Waits for every segment put on the wire; raises KVTransferError if any piece failed."""
        results = await asyncio.gather(*self.sends, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0] if isinstance(errors[0], KVTransferError) else KVTransferError(repr(errors[0]))
