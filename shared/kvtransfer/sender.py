"""KVSender: one prompt's KV, sent by the prefill worker a segment at a time as it is computed.

A piece (whole blocks, every layer; see plan.py) that is one rank's blocks as they are, consecutive
in this pool too (the block allocator hands out consecutive runs when it can), is sent straight
from the pool: no copy on either side. Any other piece (scattered blocks; heads of several ranks,
or some of one rank's, between groups of different degrees) is assembled once into a buffer of its
own in the receiver's layout (the one copy of a transfer): by the data-plane helper, or in the
engine thread between steps. The pieces of a segment go out
concurrently, each straight into the decode pool range the plan names. The prompt's blocks
must stay held until `finish` returns.
"""

import asyncio
import time
from dataclasses import dataclass, field

import torch

from shared.dataplane.plane import DataPlane, KVTransferError, nbytes
from shared.engine.kv_cache import KVPool
from shared.kvtransfer.assembly import Assembly, Part, assembled, assembly, head_slice
from shared.kvtransfer.plan import Piece, Segment, TransferPlan


@dataclass
class Staged:
    """A segment ready to go: views of the pool, and the blocks of pieces still to be gathered."""

    segment: Segment
    direct: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    scattered: list[tuple[int, Piece, list[int]]] = field(default_factory=list)


class KVSender:
    def __init__(self, plane: DataPlane, pools: list[KVPool], plan: TransferPlan, timeout_s: float):
        self.plane = plane
        self.pools = pools  # each rank's
        self.plan = plan
        self.timeout_s = timeout_s
        self.next_segment = 0  # the first segment not staged yet
        self.pieces_sent = 0  # [0, pieces_sent) may be on the wire (drained on abort)
        self.bytes_sent = 0
        self.first_sent_at = 0.0  # unix time the first piece was handed to the plane
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
        """Engine thread, no copy: views of the pool for the pieces that are one prefill rank's
        run of blocks as they are here, and the blocks of the others, to be assembled
        (`gather`) while the first travel."""
        staged = Staged(segment)
        bs = self.pools[0].block_size
        for p in segment.pieces:
            blocks = block_table[p.start // bs : p.start // bs + p.blocks]
            if p.whole and blocks == list(range(blocks[0], blocks[0] + p.blocks)):
                pool = self.pools[p.routes[0].source]
                staged.direct.append((self.plan.tag(p), pool.blocks(blocks[0], p.blocks)))
            else:
                staged.scattered.append((self.plan.tag(p), p, blocks))
        self.next_segment = segment.index + 1
        return staged

    def gather(self, staged: Staged) -> list[tuple[int, torch.Tensor | Assembly]]:
        """The one copy on this side, of the pieces staged as blocks: each assembled in the
        receiving rank's layout from its routes' heads of their ranks' runs of blocks. For a
        plane that gathers (`DataPlane.gathers`: in its helper process, off the engine), the
        Assembly that says how; else done here, in the engine thread."""
        out = []
        for tag, p, blocks in staged.scattered:
            parts = self._parts(p, blocks)
            out.append((tag, assembly(parts) if self.plane.gathers else assembled(parts)))
        if out and not self.plane.gathers and self.pools[0].kv.is_cuda:
            torch.cuda.current_stream().synchronize()  # UCX reads them on its own streams
        return out

    def _parts(self, piece: Piece, blocks: list[int]) -> list[Part]:
        """Where each route's heads of each run of consecutive blocks go in the piece."""
        parts, start = [], 0
        heads = piece.heads[1] - piece.heads[0]
        for i in range(1, len(blocks) + 1):
            if i < len(blocks) and blocks[i] == blocks[i - 1] + 1:
                continue
            for route in piece.routes:
                run = self.pools[route.source].blocks(blocks[start], i - start)
                source = head_slice(run, route.source_offset, route.heads)
                parts.append(Part(start, route.dest_offset, heads, source))
            start = i
        return parts

    def send(self, sources: list[tuple[int, torch.Tensor]]) -> asyncio.Task | None:
        """Puts pieces on the wire; the task ends when all have left."""
        if not sources:
            return None
        self.first_sent_at = self.first_sent_at or time.time()
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
