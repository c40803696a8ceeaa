"""KVSender: one prompt's KV, sent by the prefill worker a segment at a time as it is computed.

A piece whose tokens sit in consecutive slots of this pool (the block allocator hands out
consecutive runs when it can) is sent straight from the pool: no copy on either side. Any other
piece is gathered once into a buffer of its own (the one copy on this side), in the engine
thread between steps. The pieces of a segment go out concurrently, each straight into the
decode pool range the plan names. The prompt's blocks must stay held until `finish` returns.
"""

import asyncio
from dataclasses import dataclass, field

import torch

from shared.dataplane.plan import Segment, TransferPlan
from shared.dataplane.plane import DataPlane, KVTransferError, nbytes
from shared.engine.kv_cache import KVPool


@dataclass
class Staged:
    """A segment ready to go: views of the pool, and the slots of pieces still to be gathered."""

    segment: Segment
    direct: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    scattered: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)


class KVSender:
    def __init__(self, plane: DataPlane, pool: KVPool, plan: TransferPlan, timeout_s: float):
        self.plane = plane
        self.pool = pool
        self.plan = plan
        self.timeout_s = timeout_s
        self.next_segment = 0  # the first segment not staged yet
        self.pieces_sent = (
            0  # pieces [0, pieces_sent) may be on the wire (the decode side drains them on abort)
        )
        self.bytes_sent = 0
        self.sends: list[asyncio.Task] = []

    @property
    def all_staged(self) -> bool:
        return self.next_segment == len(self.plan.segments)

    def ready(self, computed_tokens: int) -> list[Segment]:
        """Segments whose every token is computed and that are not staged yet."""
        out = []
        for seg in self.plan.segments[self.next_segment :]:
            if seg.end > computed_tokens:
                break
            out.append(seg)
        return out

    def stage(self, segment: Segment, block_table: list[int]) -> Staged:
        """Engine thread, no copy: views of the pool for the pieces that are one run of slots here,
        and the slots of the others, to be gathered (`gather`) while the first ones travel."""
        sources: dict[
            tuple[int, int], int | torch.Tensor
        ] = {}  # token range -> first slot, or slots
        staged = Staged(segment)
        for p in segment.pieces:
            where = sources.get((p.start, p.end))
            if where is None:
                where = sources[(p.start, p.end)] = self._first_slot(block_table, p.start, p.end)
            if isinstance(where, int):
                staged.direct.append(
                    (self.plan.tag(p), self.pool.span(p.layer, p.kv, where, p.tokens))
                )
            else:
                staged.scattered.append((self.plan.tag(p), p.layer, p.kv, where))
        self.next_segment = segment.index + 1
        return staged

    def gather(self, staged: Staged) -> list[tuple[int, torch.Tensor | list[torch.Tensor]]]:
        """Engine thread: the one copy on this side, of the pieces whose slots are not consecutive;
        for a plane that gathers (`gathers`, in its helper process), the spans of each instead."""
        if getattr(self.plane, "gathers", False):
            return [
                (tag, self._spans(layer, kv, slots)) for tag, layer, kv, slots in staged.scattered
            ]
        out = [
            (tag, self.pool.kv[layer, kv].index_select(0, slots))
            for tag, layer, kv, slots in staged.scattered
        ]
        if (
            out and self.pool.kv.is_cuda
        ):  # UCX reads them on its own streams: the copies must have landed
            torch.cuda.current_stream().synchronize()
        return out

    def _spans(self, layer: int, kv: int, slots: torch.Tensor) -> list[torch.Tensor]:
        """The pool spans of runs of consecutive slots, in order."""
        spans, values, start = [], slots.tolist(), 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[i - 1] + 1:
                spans.append(self.pool.span(layer, kv, values[start], i - start))
                start = i
        return spans

    def _first_slot(self, block_table: list[int], start: int, end: int) -> int | torch.Tensor:
        """The first slot of positions [start, end) when they are consecutive slots, else all their slots."""
        bs = self.pool.block_size
        first, last = start // bs, (end - 1) // bs
        if all(block_table[b] == block_table[first] + b - first for b in range(first, last + 1)):
            return block_table[first] * bs + start % bs
        return self.pool.slots(block_table, start, end)

    def send(self, sources: list[tuple[int, torch.Tensor]]) -> asyncio.Task | None:
        """Puts pieces on the wire; the task ends when all have left."""
        if not sources:
            return None
        self.pieces_sent = max(
            self.pieces_sent, max(tag for tag, _ in sources) - self.plan.destination.base_tag + 1
        )
        task = asyncio.create_task(self._send_all(sources))
        self.sends.append(task)
        return task

    async def _send_all(self, pieces: list[tuple[int, torch.Tensor]]) -> None:
        await self.plane.send_many(self.plan.destination.ucx_address, pieces, self.timeout_s)
        self.bytes_sent += sum(nbytes(b) for _, b in pieces)

    async def finish(self) -> None:
        """Waits for every segment put on the wire; raises KVTransferError if any piece failed."""
        results = await asyncio.gather(*self.sends, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise (
                errors[0]
                if isinstance(errors[0], KVTransferError)
                else KVTransferError(repr(errors[0]))
            )
